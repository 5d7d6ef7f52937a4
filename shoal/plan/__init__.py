"""Planning a run: measure candidate configurations, predict their time to a target accuracy,
pick the fastest (``shoal plan``, ``shoal train --strategy auto``), and a cost model that
predicts what cannot be run here (``shoal plan --simulate``).

:func:`plan` runs Omnivore's search (:mod:`shoal.plan.search`) with real trial jobs
(:mod:`shoal.plan.planner`); :func:`plan_and_train` then trains the winner, as
``shoal train`` would have with its settings.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.env import detect_environment
from shoal.errors import ShoalError
from shoal.plan.planner import Planner, PlanOptions
from shoal.plan.search import Plan
from shoal.sweep.runner import Launcher
from shoal.train import default_workers, preflight, train
from shoal.train.outdir import OutputLock
from shoal.train.records import write_json

#: What ``shoal train --strategy auto`` plans into, inside its ``--out``.
PLAN_DIR = "plan"


def plan(cfg: TrainConfig, out: Path | None = None, launcher: Launcher | None = None) -> Plan:
    """Plan ``cfg`` (``shoal plan``): trials in ``out`` (default ``cfg.out``), with
    ``launcher`` (default: local processes); writes plan.json, plan.md, plan.png there."""
    cfg.validate()
    options = PlanOptions.of(cfg)
    if launcher is None and detect_environment() is not None:
        raise ShoalError("planning starts trial jobs of its own: run it with shoal's launcher "
                         "(shoal plan, or shoal train --strategy auto, without torchrun, Slurm "
                         "or mpirun), then start the plan's winner under yours")
    workers = default_workers(cfg)
    out = Path(cfg.out) if out is None else out
    if (out / "plan.json").exists() and not cfg.overwrite:
        raise ShoalError(f"{out} already holds a plan; pass --overwrite to plan again")
    # The data, the model and the settings, checked as shoal train checks them.
    preflight(dataclasses.replace(cfg, strategy="sync", strategy_options={}, momentum=0.0,
                                  out=str(out / "trials" / "check")), workers)
    with OutputLock(out), Launcher(None, max(60.0, options.budget_s)) as local:
        return Planner(cfg, options, launcher or local, out, workers).run()


def plan_and_train(cfg: TrainConfig) -> dict[str, Any] | None:
    """``shoal train --strategy auto``: plan into ``OUT/plan``, then train the winner in
    ``OUT``; its summary says what was planned and how long planning took."""
    found = plan(cfg, Path(cfg.out) / PLAN_DIR)
    if found.winner is None:
        raise ShoalError(f"planning found no configuration that trains: see {cfg.out}/"
                         f"{PLAN_DIR}/plan.md")
    print(f"shoal: planned in {found.planning_s:.0f} s ({len(found.trials)} trials): "
          f"{found.why}", file=sys.stderr, flush=True)
    # The winner runs as its trial did: on the trial's workers (a layout of one process with
    # all the threads, or the job's workers).
    winner = dataclasses.replace(found.winner, workers=found.trials[0].candidate.workers,
                                 overwrite=cfg.overwrite, progress=cfg.progress)
    summary = train(winner)
    if summary is not None:
        summary["plan"] = {"winner": found.trials[0].candidate.label(),
                           "planning_s": found.planning_s, "trials": len(found.trials),
                           "why": found.why}
        write_json(Path(cfg.out) / "summary.json", summary)
    return summary


def read_plan(path: Path) -> dict[str, Any]:
    """A ``plan.json`` as written by :func:`plan`."""
    return json.loads(Path(path).read_text())


__all__ = ["Plan", "PlanOptions", "Planner", "plan", "plan_and_train", "read_plan"]
