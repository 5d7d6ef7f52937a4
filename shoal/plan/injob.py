"""Planning inside the job: ``shoal train --strategy auto`` as a rank of a job that torchrun,
Slurm or mpirun started.

The job's processes are the only ones there are, so they do everything: they join the job
once (the launch path's :func:`~shoal.train.launch.join`), load the data once, train sync's probe
(:mod:`shoal.train.probe`; with a given ``--plan-budget``, none: the plan starts at step 0),
then run the plan's trials one after another as fresh trainers on the job's process group
(a :class:`JobSession`: rank 0 drives the search and hands each trial to the others, which
follow), and finally train the winner on the same processes, from the probe's checkpoint.
No planning session starts, so the plan's least cost is its first trial. Only what fits the
started processes is tried: the job's own ranks, in sync's layout or, for ``groups`` and the
asynchronous candidates, laid out anew with the first rank serving
(:func:`~shoal.train.launch.relaid`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.failures import first_line
from shoal.core.hostpath import use_host_memory
from shoal.data import Dataset
from shoal.errors import ShoalError
from shoal.plan.planner import Planner, PlanOptions, detached
from shoal.train import job_device
from shoal.train.launch import join, outside_topology, relaid
from shoal.train.optim import resolve_momentum
from shoal.train.outdir import OutputLock
from shoal.train.probe import read_verdict
from shoal.train.records import write_json
from shoal.train.trainer import Trainer
from shoal.train.workload import preflight

log = logging.getLogger("shoal.plan")

#: Where the plan goes inside ``--out`` (as ``shoal.plan.PLAN_DIR``).
PLAN_DIR = "plan"


class JobSession:
    """The planner's trials on the job's own ranks (rank 0's side): each trial's settings go
    to every rank, every rank trains them as a fresh :class:`Trainer` on ``comm``, and rank 0
    gathers how it went. What :class:`~shoal.plan.session.PlanningSession` is to a job of
    its own."""

    def __init__(self, comm: Comm, env: Environment, data: Dataset) -> None:
        self.comm, self.env, self.data = comm, env, data
        self.trials = 0

    def run(self, cfg: TrainConfig) -> float:
        """Run one trial on every rank; a failed one raises its line (the job goes on)."""
        self.trials += 1
        command = {"train": cfg.to_dict(), "tag": f"trial-{self.trials}"}
        self.comm.broadcast_object(command)
        errors = self.comm.gather_objects(_trial(command, self.comm, self.env, self.data)) or []
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise ShoalError(error)
        return 0.0  # no start-up: the ranks are running

    def close(self) -> None:
        """Nothing to end: the ranks go on with the winner."""


def _trial(command: dict[str, Any], comm: Comm, env: Environment, data: Dataset) -> str | None:
    """Train one trial (``command``: its settings and tag) on this rank; its error's line, or
    ``None``."""
    try:
        train(TrainConfig.from_dict(command["train"]), comm, env, data, command["tag"])
    except ShoalError as exc:
        return first_line(exc)
    return None


def train(cfg: TrainConfig, comm: Comm, env: Environment, data: Dataset, tag: str
          ) -> dict[str, Any] | None:
    """Train ``cfg`` on the job's ranks as a fresh trainer: on ``comm`` (its momentum for the
    job's ranks), or, for a strategy whose workers meet through servers, in its own layout of
    the same ranks (:func:`~shoal.train.launch.relaid`, on the job's store's namespace
    ``tag``); rank 0's summary."""
    if detached(cfg.strategy):
        return relaid(cfg, env, comm, data, tag)
    return Trainer(resolve_momentum(cfg, comm.world_size), comm, data).run()


def follow(comm: Comm, env: Environment, data: Dataset) -> dict[str, Any]:
    """A rank other than 0 during the plan: train each trial rank 0 hands out, until it
    hands out the winner (returned: its command)."""
    while True:
        command = comm.broadcast_object(None)
        if "final" in command:
            return command
        comm.gather_objects(_trial(command, comm, env, data))


def plan_in_job(cfg: TrainConfig, env: Environment, probe_steps: int) -> dict[str, Any] | None:
    """``shoal train --strategy auto`` as rank ``env.rank`` of an outside launcher's job:
    probe sync (``probe_steps``; with a given ``--plan-budget``, no probe), plan on the
    job's ranks if it pays, train the winner; rank 0 returns the summary."""
    if cfg.replan_every is not None:
        raise ShoalError("--replan-every re-plans between jobs of shoal's launcher; under "
                         f"{env.launcher} leave it out (the plan runs once, inside the job)")
    PlanOptions.of(cfg)  # the planning settings, checked before anything trains
    started = cfg.plan_probe_since if cfg.plan_probe_since is not None else time.time()
    auto = cfg.plan_budget == "auto"
    sync = dataclasses.replace(cfg, strategy="sync", strategy_options={},
                               plan_probe=probe_steps if auto else None, plan_probe_since=started)
    topology = outside_topology(sync, env)  # the launcher's ranks, all workers of sync's
    sync = job_device(resolve_momentum(sync, topology.workers), topology,
                      topology.local_workers(env))
    work = preflight(sync, topology.workers)
    with OutputLock(Path(cfg.out)) if env.rank == 0 else contextlib.nullcontext():
        comm = join(sync, env, topology)  # the launch path's: once, for the probe, trials, winner
        try:
            summary = _probe_plan_train(cfg, sync, comm, env, work.data, auto)
        except BaseException as exc:
            comm.abort(first_line(exc))
            raise
        comm.close()
    return summary


def _probe_plan_train(cfg: TrainConfig, sync: TrainConfig, comm: Comm, env: Environment,
                      data: Dataset, auto: bool) -> dict[str, Any] | None:
    """The probe, the plan and the winner on ``comm``'s ranks."""
    out, launched = Path(cfg.out), time.time()
    go_on, verdict = cfg, None
    if auto:
        summary = Trainer(sync, comm, data).run()
        if comm.rank == 0:
            assert summary is not None
            verdict = read_verdict(out, since=launched)
        if not comm.broadcast_object(verdict is not None and verdict["plans"]):
            return _skipped(summary, verdict, out) if comm.rank == 0 else None
    per_host = _host_processes(comm, env, cfg)
    if comm.rank != 0:
        final = follow(comm, env, data)
        train(_final(TrainConfig.from_dict(final["final"])), comm, env, data, final["tag"])
        return None
    if verdict is not None:
        go_on = dataclasses.replace(cfg, init_from=str(out / "checkpoint.pt"), init_progress=True,
                                    plan_budget=f"{verdict['budget_s']}s")
    planner = Planner(go_on, PlanOptions.of(go_on), None, out / PLAN_DIR, comm.world_size,
                      probe=verdict, session=JobSession(comm, env, data),
                      host_processes=per_host)
    found = planner.run()
    winner, label, why = found.or_sync(dataclasses.replace(sync, plan_probe=None,
                                                           **_from(go_on)))
    log.info(f"shoal: planned on the job's {comm.world_size} ranks in {found.planning_s:.0f} s "
             f"({len(found.trials)} trials): {why}")
    comm.broadcast_object({"final": winner.to_dict(), "tag": "winner"})
    summary = train(_final(winner), comm, env, data, "winner")
    assert summary is not None
    summary["plan"] = {"skipped": False, "winner": label, "planning_s": found.planning_s,
                       "trials": len(found.trials), "why": why, "probe": verdict,
                       "in_job": True}
    write_json(out / "summary.json", summary)
    return summary


def _host_processes(comm: Comm, env: Environment, cfg: TrainConfig) -> int:
    """The processes of each of the job's hosts where it spans hosts of several processes
    each whose memory can sum (the plan then tries each periodic family one replica a
    host); else 1. Every rank calls it: finding the hosts' fast path is a collective."""
    if cfg.elastic or use_host_memory(comm, "auto") is None:
        return 1
    local, world = env.local_world_size, env.world_size
    return local if 1 < local < world and world % local == 0 else 1


def _from(go_on: TrainConfig) -> dict[str, Any]:
    return {"init_from": go_on.init_from, "init_progress": go_on.init_progress}


def _final(winner: TrainConfig) -> TrainConfig:
    """The winner's settings as this job trains them (on the job's ranks, in the winner's
    layout of them)."""
    return dataclasses.replace(winner, overwrite=False, workers=None)


def _skipped(summary: dict[str, Any] | None, verdict: dict[str, Any] | None,
             out: Path) -> dict[str, Any] | None:
    """Rank 0's summary of a run the probe let go on as sync."""
    assert summary is not None
    why = verdict["why"] if verdict is not None else "the run is shorter than sync's probe: " \
        "planning skipped"
    if verdict is None:
        log.info(f"shoal: {why}")
    summary["plan"] = {"skipped": True, "why": why, "probe": verdict, "in_job": True}
    write_json(out / "summary.json", summary)
    return summary
