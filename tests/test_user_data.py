"""A user's own dataset (``--dataset file.py:factory``, dataset objects in Python) and the
background loader (``--loader-workers``): the same rows in the same order with any number of
loader processes, exact resume, one error line for what does not fit, before workers start.
"""

from __future__ import annotations

import contextlib
import io
import json
import textwrap
from pathlib import Path

import pytest
import torch

from shoal.cli import main
from shoal.data import DataOptions, EpochPlan, ShardLoader, as_dataset, load_dataset
from shoal.errors import ShoalError

from conftest import checkpoint_params, max_param_diff, one_error_line, train_together

#: A user's module: a dataset whose items carry their index (input column 0) and draw
#: torch random numbers (an augmentation), and factories of every form, right and wrong.
USER_MODULE = '''
import torch
from torch.utils.data import Dataset


class Noisy(Dataset):
    """Three Gaussian blobs in 6 dimensions; each read adds fresh noise (an augmentation)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 6, generator=g) + 2 * self.y[:, None].float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i] + 0.1 * torch.randn(6)
        x[0] = i / 256  # which sample this is (exactly), for the order test
        return x, int(self.y[i])


def make(seed=0):
    return Noisy(200, seed), Noisy(50, seed + 1)


def make_dict():
    return {"train": Noisy(40, 0), "test": Noisy(10, 1), "num_classes": 3}


def make_number():
    return 42


def make_bad_split():
    return Noisy(40, 0), 7


def make_bad_item():
    return [(torch.zeros(6), 0, 1)] * 8, Noisy(10, 1)


def make_fails():
    raise OSError("no such bucket")


def make_bad_label():
    return [(torch.zeros(6), 0), (torch.zeros(6), -1)], Noisy(10, 1)
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("user") / "user_data.py"
    path.write_text(textwrap.dedent(USER_MODULE))
    return path


def test_factory_forms_and_inferred_shape_and_classes(user_module):
    data = load_dataset(f"{user_module}:make", DataOptions(seed=3))
    assert (data.input_shape, data.num_classes, len(data.train), len(data.test)) == \
        ((6,), 3, 200, 50)
    x, y = data.train.get_batch(torch.tensor([5, 7]))
    assert x.shape == (2, 6) and y.dtype == torch.int64 and (256 * x[:, 0]).tolist() == [5, 7]
    given = load_dataset(f"{user_module}:make_dict")
    assert (given.input_shape, given.num_classes) == ((6,), 3)
    tensors = torch.utils.data.TensorDataset(torch.randn(8, 2, 4, 4), torch.arange(8) % 2)
    objects = as_dataset((tensors, tensors, (2, 4, 4), 2))
    assert objects.num_classes == 2 and objects.train.in_memory


def test_loader_workers_read_the_same_rows_in_the_same_order(user_module):
    """0 and 2 background processes: the same batches (rows, and the dataset's own random
    augmentation), bit for bit, from the start of an epoch and from a step inside it."""
    data = load_dataset(f"{user_module}:make")
    plan = EpochPlan(len(data.train), 32, 2, seed=5)

    def batches(workers: int) -> list[torch.Tensor]:
        loader = ShardLoader(data, plan, rank=1, workers=workers, seed=5)
        try:
            read = [torch.cat([x, y[:, None].float()], 1) for epoch in (0, 1)
                    for x, y, _ in loader.epoch(epoch)]
            read += [x for x, _, _ in loader.epoch(1, start=3)]
            read += [x for x, _ in loader.test_batches(16, world=2)]
            return read
        finally:
            loader.close()

    inline, background = batches(0), batches(2)
    assert len(inline) == len(background) == 2 * plan.steps_per_epoch + 4 + 2
    for a, b in zip(inline, background, strict=True):
        assert torch.equal(a, b)
    perm = plan.permutation(1)
    assert (256 * inline[plan.steps_per_epoch][:, 0]).long().tolist() == \
        plan.local(perm, 0, 1)[0].tolist()  # the plan's rows, in its order


def test_a_bad_sample_is_the_same_line_read_by_a_loader_process():
    pairs = [(torch.zeros(3), 1.0)] * 10 + [(torch.zeros(3), 7)]  # 1.0: a whole number
    data = as_dataset((pairs, pairs, (3,), 2))
    for workers in (0, 1):
        loader = ShardLoader(data, EpochPlan(11, 11, 1, seed=0), rank=0, workers=workers)
        with pytest.raises(ShoalError) as caught:
            list(loader.epoch(0))
        loader.close()
        assert str(caught.value) == "dataset (train): sample 10 has label 7, not a class in 0..1"


def test_user_factory_trains_and_resumes_exactly_with_background_loaders(tmp_path, user_module):
    """2 workers on a file.py factory: a run read by background loader processes, stopped
    mid-epoch and resumed (with another loader count), ends where an uninterrupted run read
    in the training processes does, to the bit."""
    flags = ["--model", "mlp", "--dataset", f"{user_module}:make", "--epochs", "2",
             "--batch-size", "16", "--log-every", "1"]
    ref, half, resumed = (tmp_path / n for n in ("ref", "half", "resumed"))
    summaries = train_together({
        ref: [*flags, "--loader-workers", "0"],
        half: [*flags, "--loader-workers", "2", "--stop-at-step", "10"],  # epoch 2, step 3
        resumed: [*flags, "--loader-workers", "1", "--resume", str(half / "checkpoint.pt")],
    }, workers=2)
    assert summaries[ref]["test_accuracy"] > 0.8
    assert max_param_diff(checkpoint_params(resumed / "checkpoint.pt"),
                          checkpoint_params(ref / "checkpoint.pt")) == 0.0
    for key in ("test_accuracy", "test_loss", "train_loss", "samples", "steps"):
        assert summaries[resumed][key] == summaries[ref][key], key
    losses = {run: [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").open())
                    if r["event"] == "step"] for run in (ref, resumed)}
    assert losses[resumed] == losses[ref]


def _fails(*args: str) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", "--model", "mlp", "--workers", "2", *args]) == 2, err.getvalue()
    return one_error_line(err.getvalue())


@pytest.mark.parametrize("factory, message", [
    ("make_number", "returned an int; expected (train, test), (train, test, input_shape, "
                    "num_classes), a dict with train and test, or a shoal.data.Dataset"),
    ("make_bad_split", "(test) is an int, not a map-style torch Dataset"),
    ("make_bad_item", "(train): sample 0 is a 3-tuple; expected a pair (input, label)"),
    ("make_fails", "failed to load: OSError: no such bucket"),
    ("make_bad_label", "(train): label -1 at row 1 is negative"),
    ("missing", "has no attribute 'missing'"),
])
def test_a_factory_that_does_not_fit_is_one_line_before_workers_start(tmp_path, user_module,
                                                                      factory, message):
    line = _fails("--dataset", f"{user_module}:{factory}", "--out", str(tmp_path / "run"))
    assert message in line
    assert not (tmp_path / "run").exists()  # no worker started


@pytest.mark.parametrize("args, message", [
    (["--dataset", "no_such_module_here:make"], "cannot import no_such_module_here"),
    (["--dataset", "missing_file.py:make"], "file missing_file.py does not exist"),
    (["--loader-workers", "-1"], "--loader-workers must be a number of processes from 0 to "
                                 "128, or auto, got -1"),
    (["--loader-workers", "many"], "--loader-workers must be a number of processes"),
    (["--loader-workers", "100000"], "--loader-workers must be a number of processes"),
])
def test_bad_dataset_names_and_loader_workers_are_one_line(tmp_path, args, message):
    assert message in _fails(*args, "--out", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_dataset_object_that_is_no_dataset_is_one_line():
    with pytest.raises(ShoalError, match=r"^dataset returned a dict with no test;"):
        as_dataset({"train": torch.utils.data.TensorDataset(torch.zeros(2, 3))})
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(3), 0

    with pytest.raises(ShoalError, match=r"IterableDataset; shoal shards by index"):
        as_dataset((Stream(), []))


def test_dataset_objects_train_from_python(tmp_path):
    """``shoal.train.train(cfg, dataset=...)``: the objects themselves, no name to import."""
    from shoal.config import TrainConfig
    from shoal.train import train

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (96,), generator=g)
    x = torch.randn(96, 1, 4, 4, generator=g) + 2 * y[:, None, None, None].float()
    split = torch.utils.data.TensorDataset(x, y)
    cfg = TrainConfig(model="mlp", workers=1, epochs=2, batch_size=16, out=str(tmp_path),
                      progress="none").validate()
    summary = train(cfg, dataset={"train": split, "test": split})
    assert summary["dataset"] == "<object TensorDataset>" and summary["test_accuracy"] > 0.9
    assert json.loads((tmp_path / "config.json").read_text())["dataset"] == \
        "<object TensorDataset>"
