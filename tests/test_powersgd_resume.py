"""A PowerSGD run stopped and resumed ends exactly where an uninterrupted one does.

The compression state (error feedback, the warm-started P and Q factors, the iteration count
and the seed generator) travels in the checkpoint, per parameter: a resumed DDP runs its first
step with every gradient in one bucket and only then rebuilds its buckets, so the state is
laid out again for whatever buckets the hook is handed (checked here with the real hook on
buckets of our own, since with Gloo PowerSGD only works with all gradients in one bucket).
"""

import io

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.distributed_c10d import ProcessGroupGloo

from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.errors import ShoalError
from shoal.strategies.sync import PowerSGDMemory, Synchronous, SyncOptions

from conftest import checkpoint_params, max_param_diff, train_here

CONFIG = ["--model", "lenet5", "--dataset", "digits", "--epochs", "2", "--workers", "2",
          "--batch-size", "64", "--compress", "powersgd", "--powersgd-warmup", "3"]
STEPS = 24  # 12 an epoch


# --elastic: DDP is wrapped at the first forward, so the state waits for it (the saved one
# is what a checkpoint in between holds).
@pytest.mark.parametrize("elastic", [[], ["--elastic"]], ids=["fixed", "elastic"])
def test_stopped_during_and_after_warmup_resumes_exactly(tmp_path, elastic):
    config = [*CONFIG, *elastic]
    reference = train_here(tmp_path / "reference", *config)
    assert reference["completed"] and reference["steps"] == STEPS
    out = tmp_path / "resumed"
    # Stopped during the warm-up (after 2 plain all-reduces of 3), then mid-way through
    # epoch 2 with compression and error feedback under way, then to the end.
    assert train_here(out, *config, "--stop-at-step", "2")["steps"] == 2
    state = torch.load(out / "checkpoint.pt", weights_only=True)["ranks"][1]["strategy"]
    assert state["powersgd"]["iter"] == 2 and not state["powersgd"]["memory"]
    assert train_here(out, *config, "--resume", "--stop-at-step", "18")["steps"] == 18
    state = torch.load(out / "checkpoint.pt", weights_only=True)["ranks"][1]["strategy"]
    memory = state["powersgd"]["memory"]
    assert state["powersgd"]["iter"] == 18 and memory["classifier.1.weight"]["error"].any()
    assert memory["classifier.1.weight"]["q"].shape == (64,)  # rank 1: one column of Q
    resumed = train_here(out, *config, "--resume")
    assert resumed["completed"] and resumed["steps"] == STEPS
    diff = max_param_diff(checkpoint_params(out / "checkpoint.pt"),
                          checkpoint_params(tmp_path / "reference" / "checkpoint.pt"))
    assert diff < 1e-6
    assert resumed["bytes_per_sample"] == pytest.approx(reference["bytes_per_sample"], rel=1e-9)


class Shapes(nn.Module):
    """Matrices PowerSGD compresses (two of the same shape, apart), a conv kernel, a matrix
    too small to compress and vectors it sends raw."""

    def __init__(self) -> None:
        super().__init__()
        shapes = {"conv": (6, 3, 3, 3), "conv_b": (6,), "a": (12, 16), "a_b": (12,),
                  "small": (2, 2), "b": (10, 12), "c": (12, 16), "c_b": (12,)}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))


class Bucket:
    """A stand-in for DDP's GradBucket: ``params``' gradients packed in one flat buffer."""

    def __init__(self, index: int, params: list[nn.Parameter], grads: dict[int, torch.Tensor],
                 last: bool) -> None:
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([grads[id(p)].reshape(-1) for p in params])
        self._views, at = [], 0
        for p in params:
            self._views.append(self._buffer[at:at + p.numel()].view_as(p))
            at += p.numel()

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return self._last


ONE_BUCKET = [["conv", "conv_b", "a", "a_b", "small", "b", "c", "c_b"]]  # a new DDP's first step
REBUILT = [["c_b", "c", "b"], ["small", "a", "a_b"], ["conv_b", "conv"]]  # then, backward order


def _gradients(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {name: torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


def _hook_steps(memory: PowerSGDMemory, model: nn.Module, steps: range,
                first: int) -> list[dict[str, torch.Tensor]]:
    """Run PowerSGD over each step's gradients (seeded by the step), one bucket layout on
    step ``first`` and another after it, as a fresh DDP does; what the hook returns."""
    params = dict(model.named_parameters())
    results = []
    for step in steps:
        grads = {id(params[name]): grad for name, grad in _gradients(model, step).items()}
        layout = ONE_BUCKET if step == first else REBUILT
        out = {}
        for index, names in enumerate(layout):
            bucket = Bucket(index, [params[n] for n in names], grads, index == len(layout) - 1)
            memory.align(bucket)
            powerSGD_hook.powerSGD_hook(memory.state, bucket).wait()
            out.update({n: g.clone() for n, g in zip(names, bucket.gradients(), strict=True)})
        results.append(out)
    return results


def test_state_carries_over_a_rebucketing():
    group = ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)
    model = Shapes()

    def memory() -> PowerSGDMemory:
        state = powerSGD_hook.PowerSGDState(group, matrix_approximation_rank=1,
                                            start_powerSGD_iter=3)
        return PowerSGDMemory(state, model, 1)

    straight = _hook_steps(memory(), model, range(10), first=0)
    first = memory()
    _hook_steps(first, model, range(6), first=0)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = memory()
    second.load_state_dict(torch.load(buffer, weights_only=True))
    resumed = _hook_steps(second, model, range(6, 10), first=6)
    for want, got in zip(straight[6:], resumed, strict=True):
        for name in want:
            assert torch.equal(want[name], got[name]), name
    # The matrices were sent as rank-1 approximations, the rest as they were, and the error
    # is fed back.
    assert torch.linalg.matrix_rank(resumed[-1]["a"]) == 1
    assert torch.equal(resumed[-1]["small"], _gradients(model, 9)["small"])
    assert second.state.error_dict[1].any()


def _sync(**options) -> Synchronous:
    model = nn.Linear(4, 3)
    return Synchronous(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       Comm(Environment(), torch.device("cpu")), SyncOptions(**options))


def test_unmatched_powersgd_state_is_refused():
    strategy = _sync(compress="powersgd")
    assert strategy.state_dict() == {"steps": 0, "powersgd": {"world_size": 1}}
    with pytest.raises(ShoalError, match="PowerSGD state of 2 workers.*not 1"):
        strategy.load_state_dict({"steps": 5, "powersgd": {"world_size": 2}})
    with pytest.raises(ShoalError, match="no PowerSGD state"):
        strategy.load_state_dict({"steps": 5})
    _sync().load_state_dict({"steps": 5})  # without compression nothing more is needed

