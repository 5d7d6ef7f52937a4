"""Building an optimizer does not import ``torch._dynamo`` (about 1 s of CPU, paid by every
launcher for its checks and by every parameter server), and the optimizer's methods stay
torch's own "not traced" versions wherever something compiles."""

import subprocess
import sys

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
opt.step()  # torch's step imports torch._dynamo itself
print("dynamo after step:", "torch._dynamo" in sys.modules)
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


def test_an_optimizer_is_built_without_dynamo_and_keeps_torchs_versions_once_it_is_imported():
    res = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         env=shoal_env(), timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "dynamo after build: False", "dynamo after step: True", "torch's version: True",
        "stepped: True", "compiled step: True"], res.stdout + res.stderr
