"""Building and stepping an optimizer does not import ``torch._dynamo`` (about 1 s of CPU,
paid by every launcher for its checks, every parameter server and every worker that steps
without DDP), its steps equal torch's own optimizer's, and the optimizer's methods stay
torch's own "not traced" versions wherever something compiles."""

import subprocess
import sys

import pytest

from conftest import shoal_env

PROGRAM = r"""
import sys
import torch
from shoal.config import TrainConfig
from shoal.train.optim import build_optimizer

model = torch.nn.Linear(3, 2)
cfg = TrainConfig(model="mlp", dataset="digits", momentum=0.9).validate()
opt = build_optimizer(cfg, model.parameters(), 0.1)
opt.zero_grad()
state = opt.state_dict()
print("dynamo after build:", "torch._dynamo" in sys.modules)
before = [p.detach().clone() for p in model.parameters()]
model(torch.ones(4, 3)).sum().backward()
opt.step()  # torch's own step would import torch._dynamo
print("dynamo after step:", "torch._dynamo" in sys.modules, torch.is_grad_enabled())
for name, flags in (("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
                    ("adamw", {"weight_decay": 1e-2})):
    ours, theirs = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    theirs.load_state_dict(ours.state_dict())
    mine = build_optimizer(TrainConfig(model="mlp", dataset="digits", optimizer=name,
                                       **flags).validate(), ours.parameters(), 0.1)
    ref = (torch.optim.SGD(theirs.parameters(), lr=0.1, **flags) if name == "sgd"
           else torch.optim.AdamW(theirs.parameters(), lr=0.1, **flags))
    for m, o in ((ours, mine), (theirs, ref)):  # torch's own step imports torch._dynamo
        if o is ref:
            print(f"dynamo after {name}'s steps:", "torch._dynamo" in sys.modules)
        for step in range(3):
            o.zero_grad()
            m(torch.full((4, 3), step + 1.0)).square().sum().backward()
            o.step()
    same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    print(f"{name} as torch's:", same, type(mine).__name__, isinstance(mine, type(ref)))
import torch._dynamo
fn = torch.optim.Optimizer.zero_grad.__wrapped__
opt.zero_grad()  # the first call after the import takes torch's version
real = getattr(fn, "__dynamo_disable")
print("torch's version:", getattr(real, "_torchdynamo_disable", False))
moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
print("stepped:", moved and all(p.grad is None for p in model.parameters()))

@torch.compile(backend="eager")
def train_step(x):
    loss = model(x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss

train_step(torch.ones(4, 3))
print("compiled step:", all(p.grad is None for p in model.parameters()))
"""


DDP_PROGRAM = r"""
import importlib
import runpy
import sys
import torch
import shoal
from shoal.config import TrainConfig
from shoal.train.optim import build_optimizer


def steps(compiled):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cfg = TrainConfig(model="mlp", dataset="digits", momentum=0.9).validate()
    opt = build_optimizer(cfg, model.parameters(), 0.1)  # torch's own would import it
    if compiled:
        importlib.import_module("torch._dynamo")  # as a user's torch.compile does
    strategy = shoal.strategy("sync", model, opt)
    forward = torch.compile(strategy.module, backend="eager") if compiled else strategy.module
    for step in range(3):
        forward(torch.full((4, 3), step + 1.0)).square().sum().backward()
        strategy.step()
        opt.zero_grad()
    return "torch._dynamo" in sys.modules, [p.detach().tolist() for p in model.parameters()]


if __name__ == "__main__":
    runpy.run_path(sys.argv[1])  # PROGRAM, in this process before anything else of it
    plain, compiled = shoal.launch(steps, False, workers=2), shoal.launch(steps, True, workers=2)
    print("dynamo in plain workers:", [d for d, _ in plain])
    print("dynamo in compiling workers:", [d for d, _ in compiled])
    print("same steps:", all(p == c for (_, p), (_, c) in zip(plain, compiled)))
"""


@pytest.fixture(scope="class")
def printed(tmp_path_factory) -> tuple[list[str], str]:
    """What PROGRAM, then DDP_PROGRAM print (its lines, and with stderr for a message), run
    by one interpreter (one import of torch): PROGRAM first, before anything else of it has
    run, as it would alone; DDP_PROGRAM's workers come from a server of their own (a fresh
    interpreter, whatever PROGRAM imported)."""
    tmp_path = tmp_path_factory.mktemp("dynamo")
    (tmp_path / "optimizer.py").write_text(PROGRAM)
    (tmp_path / "ddp.py").write_text(DDP_PROGRAM)
    res = subprocess.run([sys.executable, "ddp.py", "optimizer.py"], capture_output=True,
                         text=True, env=shoal_env(), timeout=480, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines(), res.stdout + res.stderr


class TestDynamo:
    """PROGRAM's checks (the optimizer in one process) and DDP_PROGRAM's (in workers)."""

    def test_an_optimizer_is_built_and_stepped_without_dynamo_and_keeps_torchs_versions_once_it_is(
            self, printed):
        lines, output = printed
        assert lines[:9] == [
            "dynamo after build: False", "dynamo after step: False True",
            "dynamo after sgd's steps: False", "sgd as torch's: True SGD True",
            "dynamo after adamw's steps: True", "adamw as torch's: True AdamW True",
            "torch's version: True", "stepped: True",
            "compiled step: True"], output

    def test_ddp_trains_without_dynamo_and_with_it_once_something_compiles(self, printed):
        """A ``sync`` worker's DDP (with shoal's optimizer) never imports ``torch._dynamo``
        (1.8 s of CPU at each start) while nothing compiles; a worker that compiles its DDP
        module steps the same."""
        lines, output = printed
        assert lines[9:] == [
            "dynamo in plain workers: [False, False]", "dynamo in compiling workers: [True, True]",
            "same steps: True"], output
