"""Each low-communication strategy equals a reference written straight from its equations.

A least-squares problem in float64 is trained for a few steps by 1, 2 and 3 real Gloo
workers through ``shoal.strategy(...)``; the reference simulates the same workers serially
with analytic gradients and the update rules written out by hand (no torch.optim, no
autograd, no collectives). Every worker's parameters and the center (EASGD) or global model
(DiLoCo) must match to float tolerance. Limiting cases: local SGD with tau=1 and plain SGD
is synchronous gradient averaging; EASGD with alpha=0 never moves the center; DiLoCo with
outer lr 1 and no outer momentum is local SGD.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shoal
from shoal.comm import Comm
from shoal.launch import Environment, spawn

DIM, BATCH, STEPS, LR = 5, 12, 7, 0.05

# name, strategy, options, optimizer momentum, nesterov
CASES = {
    "local-sgd-t1-plain": ("local-sgd", {"tau": 1}, 0.0),
    "local-sgd-t1": ("local-sgd", {"tau": 1}, 0.9),
    "local-sgd-t3": ("local-sgd", {"tau": 3}, 0.9),
    "local-sgd-t3-measure-wait": ("local-sgd", {"tau": 3, "measure_wait": True}, 0.9),
    "easgd-t1": ("easgd", {"tau": 1}, 0.0),
    "easgd-t3": ("easgd", {"tau": 3, "alpha": 0.3}, 0.0),
    "easgd-t2-no-overlap": ("easgd", {"tau": 2, "overlap": False}, 0.0),
    "easgd-alpha0": ("easgd", {"tau": 2, "alpha": 0.0}, 0.0),
    "eamsgd-t2": ("eamsgd", {"tau": 2}, 0.9),
    "diloco-t2": ("diloco", {"tau": 2, "outer_lr": 0.7, "outer_momentum": 0.9}, 0.0),
    "diloco-t3": ("diloco", {"tau": 3, "outer_lr": 0.5, "outer_momentum": 0.5}, 0.9),
    "diloco-as-local-sgd": ("diloco", {"tau": 3, "outer_lr": 1.0, "outer_momentum": 0.0}, 0.9),
}


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Data for STEPS global batches, and the initial parameter vector [w..., b]."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, DIM, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(DIM, generator=gen, dtype=torch.float64) + 0.1 * torch.randn(
        STEPS * BATCH, generator=gen, dtype=torch.float64)
    return x, y, 0.1 * torch.randn(DIM + 1, generator=gen, dtype=torch.float64)


def rows(step: int, rank: int, world: int) -> slice:
    base = step * BATCH
    return slice(base + rank * BATCH // world, base + (rank + 1) * BATCH // world)


# -- through shoal -------------------------------------------------------------------------
def run_case(name: str, comm: Comm) -> dict[str, list[float]]:
    kind, options, momentum = CASES[name]
    x, y, init = problem()
    model = torch.nn.Linear(DIM, 1).double()
    with torch.no_grad():
        model.weight.copy_(init[:DIM].view(1, DIM))
        model.bias.copy_(init[DIM:])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    strategy = shoal.strategy(kind, model, optimizer, comm=comm, **options)
    waited = comm.timeline.totals.get("wait", 0.0)
    for step in range(STEPS):
        batch = rows(step, comm.rank, comm.world_size)
        loss = torch.nn.functional.mse_loss(strategy.module(x[batch]).squeeze(1), y[batch])
        strategy.backward(loss)
        strategy.step()
        strategy.zero_grad()
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()  # noqa: E731
    return {"x": flat(model), "eval": flat(strategy.eval_module),
            "waited": comm.timeline.totals.get("wait", 0.0) > waited}


def run_all(out_dir: str) -> None:
    comm = shoal.init(device="cpu")
    results = {name: run_case(name, comm) for name in CASES}
    Path(out_dir, f"rank{comm.rank}.json").write_text(json.dumps(results))
    shoal.shutdown()


@pytest.fixture(scope="module")
def shoal_results(tmp_path_factory) -> dict[int, list[dict]]:
    """world size -> each rank's results for every case."""
    found = {}
    single = Comm(Environment(), torch.device("cpu"))
    found[1] = [{name: run_case(name, single) for name in CASES}]
    for world in (2, 3):
        out = tmp_path_factory.mktemp(f"world{world}")
        spawn(world, run_all, (str(out),))
        found[world] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return found


# -- the reference, from the equations ---------------------------------------------------------
def grad(p: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """Gradient of mean((xb w + b - yb)^2) with respect to [w, b]."""
    r = xb @ p[:DIM] + p[DIM] - yb
    return torch.cat([2 * xb.T @ r, (2 * r.sum()).view(1)]) / len(yb)


def reference(name: str, world: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Every worker's parameters and the model to evaluate (None: each worker's own)."""
    kind, options, mu = CASES[name]
    x, y, init = problem()
    tau = options["tau"]
    ps = [init.clone() for _ in range(world)]
    vs = [torch.zeros_like(init) for _ in range(world)]
    center = init.clone()  # EASGD's x~, DiLoCo's theta
    outer_buf: torch.Tensor | None = None
    nesterov = kind == "eamsgd"
    alpha = options.get("alpha", 0.9 / world)
    for step in range(STEPS):
        for i in range(world):
            g = grad(ps[i], x[rows(step, i, world)], y[rows(step, i, world)])
            if mu:  # torch.optim.SGD's momentum: v = mu v + g; step along v (or g + mu v)
                vs[i] = mu * vs[i] + g if step else g.clone()
                g = g + mu * vs[i] if nesterov else vs[i]
            ps[i] = ps[i] - LR * g
        if (step + 1) % tau:
            continue
        if kind == "local-sgd":
            mean = sum(ps) / world
            ps = [mean.clone() for _ in range(world)]
        elif kind in ("easgd", "eamsgd"):
            diffs = [alpha * (p - center) for p in ps]
            ps = [p - d for p, d in zip(ps, diffs, strict=True)]
            center = center + sum(diffs)
        else:  # diloco: outer Nesterov SGD on the mean pseudo-gradient
            delta = sum(center - p for p in ps) / world
            m, lr_out = options["outer_momentum"], options["outer_lr"]
            outer_buf = delta if outer_buf is None else m * outer_buf + delta
            center = center - lr_out * (delta + m * outer_buf if m else delta)
            ps = [center.clone() for _ in range(world)]
    return ps, (None if kind == "local-sgd" else center)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_strategy_matches_its_equations(shoal_results, name, world):
    ps, evaluated = reference(name, world)
    for rank in range(world):
        got = shoal_results[world][rank][name]
        torch.testing.assert_close(torch.tensor(got["x"], dtype=torch.float64), ps[rank],
                                   atol=1e-10, rtol=1e-9, msg=f"rank {rank}'s parameters")
        torch.testing.assert_close(torch.tensor(got["eval"], dtype=torch.float64),
                                   ps[rank] if evaluated is None else evaluated,
                                   atol=1e-10, rtol=1e-9, msg=f"rank {rank}'s evaluated model")


@pytest.mark.parametrize("world", [2, 3])
def test_limiting_cases(shoal_results, world):
    res = shoal_results[world][0]
    # local SGD, tau=1, plain SGD == synchronous SGD on the global batch
    x, y, p = problem()
    for step in range(STEPS):
        p = p - LR * grad(p, x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH])
    torch.testing.assert_close(torch.tensor(res["local-sgd-t1-plain"]["x"], dtype=torch.float64), p)
    # EASGD with alpha = 0: the center stays where it started
    torch.testing.assert_close(torch.tensor(res["easgd-alpha0"]["eval"], dtype=torch.float64),
                               problem()[2])
    # --measure-wait books time as waiting for peers and changes nothing else
    assert res["local-sgd-t3-measure-wait"]["waited"] and not res["local-sgd-t3"]["waited"]
    # DiLoCo with outer lr 1 and no momentum == local SGD with the same tau
    torch.testing.assert_close(torch.tensor(res["diloco-as-local-sgd"]["x"], dtype=torch.float64),
                               torch.tensor(res["local-sgd-t3"]["x"], dtype=torch.float64))
