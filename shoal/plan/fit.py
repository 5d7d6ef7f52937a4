"""Fitting the cost model's :class:`~shoal.strategies.cost.Machine` to measured throughputs, with a
held-out check (benchmarks/bench_model.py; docs/performance.md#cost-model).

What the calibration cannot measure alone are the things of processes that share one
machine's cores (the emulated cluster's): the ``contention`` of processes computing side by
side, the ``noise`` of a step's compute that synchronous workers wait for, a server's own
``server_work`` per byte and what an exchange with the servers costs beyond its bytes
(``exchange_s``). They are fitted by least squares of the log errors over a grid
(:data:`GRIDS`, coordinate descent). The check: the points are split in folds (every
``folds``-th point in one), the parameters fitted on the other folds' points, and each point
predicted by parameters that never saw it.

A measured point is a dict: ``network`` (``"local"``, or an emulated rate such as
``"100mbit"``), ``strategy`` (a ``--strategies`` spec), ``workers`` and ``samples_per_s``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shoal.core.hostspec import PAYLOAD, burst_bytes, rate_bits
from shoal.errors import ShoalError
from shoal.plan.simulate import Workload, parse_bandwidth, predict, workloads
from shoal.strategies.cost import Calibration, Machine, Network

#: The free parameters and the grids they are fitted on.
GRIDS = {"contention": tuple(i / 100 for i in range(0, 101, 2)),
         "noise": tuple(i / 50 for i in range(0, 101)),
         "server_work": tuple(i / 4 for i in range(0, 81)),
         "exchange_s": tuple(i / 10000 for i in range(0, 51))}


@dataclass(frozen=True)
class Setting:
    """What the points were measured with: ``batch`` samples per worker, a model of
    ``params`` float32 parameters, the machine's ``cores``, and the calibrations of this
    machine's processes (``local``) and of the emulated cluster's endpoints (``emulated``)."""

    batch: int
    params: int
    cores: int
    local: Calibration
    emulated: Calibration


def network(name: str) -> Network:
    """A point's network: this machine's processes (``"local"``), or the emulated cluster's
    links of that rate (their TCP payload's share of it, the calibrated endpoint cost, and
    the token bucket ``tbf`` gives them)."""
    if name == "local":
        return Network()
    return Network(parse_bandwidth(name) * PAYLOAD, 0.0, host_cost=True,
                   burst_bytes=burst_bytes(rate_bits(name)))


@functools.cache
def _workload(spec: str) -> Workload:
    """A strategy spec's workload, built once: a fit asks for it at every point it tries
    (building its options, type hints and all, took 5 of a fit's 6 seconds)."""
    return workloads(spec, {})[0]


def predicted(points: Sequence[dict[str, Any]], setting: Setting, machine: Machine) -> list[float]:
    """Each point's predicted samples/s, its processes on ``machine``."""
    return [predict(_workload(p["strategy"]), p["workers"], setting.batch, setting.params,
                    setting.local if p["network"] == "local" else setting.emulated,
                    network(p["network"]), machine).samples_per_s for p in points]


def fit(points: Sequence[dict[str, Any]], setting: Setting, rounds: int = 40) -> Machine:
    """The machine on :data:`GRIDS` with the least sum of squared log errors on ``points``:
    from no contention, noise or work, passes of coordinate descent, then steps to the best
    of the neighbouring grid points (every parameter one grid step either way or kept: the
    valleys where two parameters trade off), until nothing improves (at most ``rounds``
    passes of each)."""
    if not points:
        raise ShoalError("fitting the cost model needs measured points")
    names = list(GRIDS)

    @functools.cache
    def loss(at: tuple[int, ...]) -> float:
        m = machine(at)
        return sum(math.log(q / p["samples_per_s"]) ** 2
                   for q, p in zip(predicted(points, setting, m), points, strict=True))

    def machine(at: tuple[int, ...]) -> Machine:
        return Machine(setting.cores, **{k: GRIDS[k][i] for k, i in zip(names, at, strict=True)})

    at = (0,) * len(names)
    for _ in range(rounds):
        before = at
        for d, name in enumerate(names):
            at = min((at[:d] + (i,) + at[d + 1:] for i in range(len(GRIDS[name]))), key=loss)
        if at == before:
            break
    for _ in range(rounds):
        near = [tuple(i + s for i, s in zip(at, steps, strict=True))
                for steps in itertools.product((-1, 0, 1), repeat=len(names))]
        best = min((n for n in near if all(0 <= i < len(GRIDS[k]) for k, i in
                                           zip(names, n, strict=True))), key=loss)
        if best == at:
            break
        at = best
    return machine(at)


def parameters(machine: Machine) -> dict[str, float]:
    """The fitted parameters of ``machine``, by name."""
    return {k: getattr(machine, k) for k in GRIDS}


def check(points: Sequence[dict[str, Any]], setting: Setting, folds: int = 2) -> dict[str, Any]:
    """Every point predicted twice: by the machine fitted on all points (``predicted``,
    ``error``), and by the one fitted on the other folds' points alone (``held_out``,
    ``held_out_error``; point ``i`` is in fold ``i % folds``). Errors are relative:
    predicted over measured, minus one."""
    if folds < 2 or len(points) < folds:
        raise ShoalError(f"a held-out check needs at least 2 folds and a point in each, got "
                         f"{folds} folds of {len(points)} points")
    rows = [dict(p) for p in points]
    machine = fit(rows, setting)
    for r, q in zip(rows, predicted(rows, setting, machine), strict=True):
        r.update(predicted=q, error=q / r["samples_per_s"] - 1)
    by_fold = []
    for fold in range(folds):
        mine = [r for i, r in enumerate(rows) if i % folds == fold]
        other = fit([r for i, r in enumerate(rows) if i % folds != fold], setting)
        by_fold.append(parameters(other))
        for r, q in zip(mine, predicted(mine, setting, other), strict=True):
            r.update(held_out=q, held_out_error=q / r["samples_per_s"] - 1)
    return {"fitted": parameters(machine), "folds": by_fold, "points": rows}
