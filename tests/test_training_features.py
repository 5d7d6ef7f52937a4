"""--accumulate, --precision, --clip-grad-norm, --channels-last and --compile: accumulation
equals the larger batch, bf16 learns digits, clipping bounds the update, the float16 scaler
skips overflowing steps and is checkpointed, bad values are one line before workers start."""

import pytest
import torch
from test_cli_errors import fails

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.flat import FlatParams
from shoal.models import build_model
from shoal.strategies import get_strategy, make_options
from shoal.strategies.easgd import parameter_order
from shoal.strategies.precision import MixedPrecision, micro_batches
from shoal.train.optim import build_optimizer, resolve_momentum
from shoal.train.trainer import Trainer

from conftest import checkpoint_params, max_param_diff, train_together
from ps_doubles import LoopbackClient

DIGITS = ["--model", "lenet5", "--dataset", "digits", "--workers", "2", "--seed", "3"]
LR, CLIP = 0.1, 0.05


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every sync-family run of this file in one set of two worker processes."""
    root = tmp_path_factory.mktemp("features")
    short = [*DIGITS, "--epochs", "1", "--schedule", "constant"]
    one_step = [*DIGITS, "--epochs", "1", "--stop-at-step", "1", "--lr", str(LR),
                "--momentum", "0", "--schedule", "constant"]
    flags = {
        "accumulated": [*short, "--batch-size", "8", "--accumulate", "4"],
        "large": [*short, "--batch-size", "32"],
        "bf16": [*DIGITS, "--epochs", "6", "--precision", "bf16-mixed", "--channels-last"],
        "fp16": [*short, "--precision", "16-mixed", "--accumulate", "2", "--clip-grad-norm", "1"],
        "local-sgd": [*short, "--strategy", "local-sgd", "--tau", "2", "--accumulate", "3",
                      "--precision", "bf16-mixed", "--clip-grad-norm", "1"],
        "clipped": [*one_step, "--clip-grad-norm", str(CLIP)],
    }
    dirs = {name: root / name for name in flags}
    summaries = train_together({dirs[name]: f for name, f in flags.items()}, workers=2)
    return {name: (dirs[name], summaries[dirs[name]]) for name in flags}


def test_accumulation_equals_the_larger_batch(runs):
    (acc, s_acc), (large, s_large) = runs["accumulated"], runs["large"]
    assert s_acc["global_batch"] == s_large["global_batch"] == 64
    assert s_acc["steps"] == s_large["steps"] == 23  # optimizer steps
    assert s_acc["samples"] == s_large["samples"] == 1437  # every sample once in the epoch
    diff = max_param_diff(checkpoint_params(acc / "checkpoint.pt"),
                          checkpoint_params(large / "checkpoint.pt"))
    assert diff < 1e-5, diff


def test_bf16_mixed_learns_digits(runs):
    summary = runs["bf16"][1]
    assert summary["test_accuracy"] >= 0.93, summary["test_accuracy"]
    params = checkpoint_params(runs["bf16"][0] / "checkpoint.pt")
    assert all(p.dtype == torch.float32 for p in params.values())  # float32 master weights


def test_fp16_and_accumulation_with_averaging_run(runs):
    fp16, fp32 = runs["fp16"][1], runs["large"][1]  # the same global batch, 64
    assert fp16["train_loss"] == pytest.approx(fp32["train_loss"], abs=1e-3)
    # After one epoch lenet5 sits just below chance's loss, where a rounding flips the argmax
    # of nearly equal outputs (test accuracy 47.2% or 47.5% by the CPU's kernels): the test
    # loss, which moves smoothly, is compared instead (fp16 that did not learn: 0.03 apart).
    assert fp16["test_loss"] == pytest.approx(fp32["test_loss"], abs=5e-3)
    summary = runs["local-sgd"][1]
    assert summary["completed"] and summary["steps"] == 15  # 1437 samples, 96 a step
    assert summary["train_loss"] < 2.31  # from ln 10 = 2.30
    saved = torch.load(runs["fp16"][0] / "checkpoint.pt", weights_only=True)
    scaler = saved["ranks"][0]["precision"]["scaler"]
    assert scaler["scale"] > 0 and scaler == saved["ranks"][1]["precision"]["scaler"]


def test_clipping_bounds_the_applied_update(runs):
    torch.manual_seed(3)
    start = build_model("lenet5", (1, 8, 8), 10).state_dict()

    def update_norm(name):
        after = checkpoint_params(runs[name][0] / "checkpoint.pt")
        return sum((after[k].double() - start[k].double()).pow(2).sum() for k in start).sqrt()

    # Plain SGD: the update is lr x the gradient (of norm 0.23 at this step).
    # Clipped after the all-reduce, its norm is exactly lr x CLIP (two ranks' gradients
    # clipped before averaging would give less).
    assert update_norm("clipped") == pytest.approx(LR * CLIP, rel=1e-4)


@pytest.fixture
def one_thread():
    """In-process training on one thread: the two cores are shared by the test workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_in_process(out, **settings):
    """One worker's Trainer in this process (no worker processes to start); an asynchronous
    strategy's server is a LoopbackClient holding the initial model. Returns the trainer."""
    cfg = resolve_momentum(TrainConfig(model="mlp", dataset="digits", epochs=1, out=str(out),
                                       progress="none", schedule="constant",
                                       **settings).validate(), 1)
    comm = Comm(Environment(), torch.device("cpu"), peers=False)
    cls = get_strategy(cfg.strategy)
    if getattr(cls, "Rule", None) is not None:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, (1, 8, 8), 10)
        order = parameter_order(model, build_optimizer(cfg, model.parameters(), cfg.base_lr(1)))
        center = FlatParams(order).pack().clone()
        comm.ps = LoopbackClient([cls.Rule(center, make_options(cls, {}))], [center])
    trainer = Trainer(cfg, comm)
    trainer.run()
    return trainer


def test_an_asynchronous_strategy_pushes_the_accumulated_gradient(tmp_path, one_thread):
    # async-sgd with one worker is SGD on the server: 4 micro-batches of 8 must push the
    # gradient of the batch of 32, once per step.
    micro = train_in_process(tmp_path / "a", strategy="async-sgd", batch_size=8, accumulate=4,
                             stop_at_step=12)
    whole = train_in_process(tmp_path / "b", strategy="async-sgd", batch_size=32,
                             stop_at_step=12)
    assert micro.strategy.clock == whole.strategy.clock == 12
    diff = (micro.comm.ps.centers[0] - whole.comm.ps.centers[0]).abs().max().item()
    assert diff < 1e-5, diff


def test_fp16_accumulated_run_resumes_exactly(tmp_path, one_thread):
    settings = {"precision": "16-mixed", "batch_size": 5, "accumulate": 3}
    whole = train_in_process(tmp_path / "whole", stop_at_step=14, **settings)
    train_in_process(tmp_path / "split", stop_at_step=7, **settings)
    resumed = train_in_process(tmp_path / "split", stop_at_step=14, resume="", **settings)
    assert max_param_diff(whole.model.state_dict(), resumed.model.state_dict()) == 0
    assert resumed.amp.state_dict() == whole.amp.state_dict()


def test_scaler_skips_an_overflowing_step_and_keeps_its_state():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp = MixedPrecision("16-mixed", torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    amp.scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")  # an overflow
    assert not amp.unscale(opt)
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    amp.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert amp.skipped == 1 and amp.scaler.get_scale() == 2.0**15  # halved from 2^16
    again = MixedPrecision("16-mixed", torch.device("cpu"))
    again.load_state_dict(amp.state_dict())
    assert again.scaler.get_scale() == 2.0**15 and again.skipped == 1


def test_micro_batches_cover_every_row_once():
    assert list(micro_batches(10, 4)) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert list(micro_batches(2, 4)) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("args, message", [
    (["--accumulate", "0"], "--accumulate must be at least 1, got 0"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive number, got 0"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm must be a positive number"),
    (["--clip-grad-norm", "nan"], "--clip-grad-norm must be a positive number"),
    (["--model", "mlp", "--dataset", "synthetic", "--synthetic-shape", "20", "--channels-last"],
     "--channels-last needs image inputs"),
])
def test_bad_values_are_one_line(tmp_path, args, message):
    assert message in fails("train", "--out", str(tmp_path / "run"), *args)
    assert not (tmp_path / "run").exists()


def test_compile_without_a_compiler_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert "--compile on the CPU needs a C++ compiler" in fails(
        "train", "--out", str(tmp_path / "run"), "--device", "cpu", "--compile")


def test_precision_from_a_config_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("precision: fp8\n")
    assert "precision must be one of 32, bf16-mixed, 16-mixed, got 'fp8'" in fails(
        "train", "--config", str(config), "--out", str(tmp_path / "run"))


def test_the_features_in_an_own_loop(one_thread):
    # shoal.strategies.precision's recipe, in one process: bf16 autocast, 3 micro-batches,
    # clipping; the parameters stay float32 and the loss falls.
    import shoal
    from shoal.strategies.precision import clip_gradients

    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    comm = Comm(Environment(), torch.device("cpu"))
    strategy = shoal.strategy("sync", model, optimizer, comm=comm)
    amp = MixedPrecision("bf16-mixed", comm.device)
    strategy.scaler = amp.scaler
    losses = []
    for epoch in range(8):
        for xb, yb in strategy.batches((x, y), batch_size=3 * 8, epoch=epoch):
            pieces = list(micro_batches(len(xb), 3))
            for i, (lo, hi) in enumerate(pieces):
                with strategy.no_sync(i < len(pieces) - 1):
                    with amp.autocast():
                        loss = torch.nn.functional.cross_entropy(strategy.module(xb[lo:hi]),
                                                                 yb[lo:hi])
                    strategy.backward(loss * (hi - lo) / len(xb))
                losses.append(loss.item())
            if amp.unscale(optimizer):
                assert clip_gradients(model, 1.0) > 0
            strategy.step()
            amp.update()
            strategy.zero_grad()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(losses[-12:]) < sum(losses[:12])
