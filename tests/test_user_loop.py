"""A hand-written PyTorch loop becomes data-parallel with shoal.strategy (Fabric style)."""

import torch

import shoal
from shoal.core.processes import spawn

STEPS, BATCH = 8, 12


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 10, generator=gen)
    return x, (x @ torch.randn(10, 1, generator=gen)).squeeze(1)


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def user_loop(out_path: str) -> None:
    model, optimizer = make()
    strategy = shoal.strategy("sync", model, optimizer)
    rank, world = strategy.comm.rank, strategy.comm.world_size
    x, y = data()
    for step in range(STEPS):
        lo = step * BATCH + rank * BATCH // world
        hi = step * BATCH + (rank + 1) * BATCH // world
        loss = torch.nn.functional.mse_loss(strategy.module(x[lo:hi]).squeeze(1), y[lo:hi])
        strategy.backward(loss)
        strategy.step()
        strategy.zero_grad()
    if rank == 0:
        torch.save(model.state_dict(), out_path)
    shoal.shutdown()


def test_strategy_in_a_user_loop_equals_serial_training(tmp_path):
    out = tmp_path / "params.pt"
    spawn(2, user_loop, (str(out),))
    model, optimizer = make()
    x, y = data()
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        torch.nn.functional.mse_loss(model(x[batch]).squeeze(1), y[batch]).backward()
        optimizer.step()
        optimizer.zero_grad()
    parallel = torch.load(out, weights_only=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(parallel[name], value, atol=1e-6, rtol=1e-5)
