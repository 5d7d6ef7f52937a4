"""Planning a run: measure candidate configurations, predict their time to a target accuracy,
pick the fastest (``shoal plan``, ``shoal train --strategy auto``), and a cost model that
predicts what cannot be run here (``shoal plan --simulate``).

:func:`plan` runs Omnivore's search (:mod:`shoal.plan.search`) with real trial jobs
(:mod:`shoal.plan.planner`); :func:`plan_and_train` then trains the winner, as
``shoal train`` would have with its settings, and with ``--replan-every`` re-plans from the
run's checkpoint every period (Omnivore's periodic re-optimization, within a tenth of the
period) and goes on with the new winner from there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.env import detect_environment, rank_environment
from shoal.core.files import check_output_dir
from shoal.data import EpochPlan, load_dataset
from shoal.errors import ShoalError
from shoal.plan.outcome import start_of
from shoal.plan.planner import Planner, PlanOptions
from shoal.plan.search import Plan, Trial
from shoal.schema import parse_duration
from shoal.sweep.runner import Launcher
from shoal.train import default_workers, preflight, train
from shoal.train.checkpoint import load_checkpoint, save_checkpoint
from shoal.train.outdir import OutputLock
from shoal.train.probe import PLAN_SHARE, read_verdict
from shoal.train.records import write_json
from shoal.train.trainer import data_options

log = logging.getLogger("shoal.plan")

#: What ``shoal train --strategy auto`` plans into, inside its ``--out``; re-plan ``k`` into
#: ``plan-<k>``.
PLAN_DIR = "plan"
#: A re-plan may take at most this share of the period it follows (Omnivore's overhead).
REPLAN_SHARE = PLAN_SHARE
#: The sync steps ``--strategy auto``'s probe times (the run's own first steps).
PROBE_STEPS = 20
#: ``shoal plan --plan-budget auto``: a bound on a trial's (and a session's) job before the
#: budget is known.
AUTO_TIMEOUT_S = 6 * 3600.0


def plan(cfg: TrainConfig, out: Path | None = None, launcher: Launcher | None = None,
         incumbent: Trial | None = None, probe: dict[str, Any] | None = None) -> Plan:
    """Plan ``cfg`` (``shoal plan``): trials in ``out`` (default ``cfg.out``), with
    ``launcher`` (default: local processes); writes plan.json, plan.md, plan.png there. A
    re-plan (``cfg`` goes on from a checkpoint) measures the ``incumbent`` first; a plan
    after ``--strategy auto``'s ``probe`` (from its checkpoint) takes sync's speed from it."""
    cfg.validate()
    options = PlanOptions.of(cfg)
    if launcher is None and detect_environment() is not None:
        raise ShoalError("planning starts trial jobs of its own: run it with shoal's launcher "
                         "(shoal plan, or shoal train --strategy auto, without torchrun, Slurm "
                         "or mpirun), then start the plan's winner under yours")
    workers = default_workers(cfg)
    out = Path(cfg.out) if out is None else out
    check_output_dir(out)
    if (out / "plan.json").exists() and not cfg.overwrite:
        raise ShoalError(f"{out} already holds a plan; pass --overwrite to plan again")
    # The data, the model and the settings, checked as shoal train checks them.
    preflight(dataclasses.replace(cfg, strategy="sync", strategy_options={}, momentum=0.0,
                                  out=str(out / "trials" / "check")), workers)
    # A planning session lives through the whole plan (its budget and a last trial past it).
    timeout = AUTO_TIMEOUT_S if options.budget_s is None else 60.0 + 2 * options.budget_s
    with OutputLock(out), Launcher(None, timeout) as local:
        return Planner(cfg, options, launcher or local, out, workers,
                       incumbent=incumbent, probe=probe).run()


def plan_and_train(cfg: TrainConfig) -> dict[str, Any] | None:
    """``shoal train --strategy auto``: plan into ``OUT/plan``, then train the winner in
    ``OUT``; its summary says what was planned and how long planning took. With
    ``--plan-budget auto`` (the default) sync's probe comes first (:func:`probe_and_train`);
    with ``--replan-every`` too, every plan's budget is a tenth of the period."""
    env = rank_environment()
    if env is not None:  # a rank of torchrun's, Slurm's or mpirun's job: plan on its ranks
        from shoal.plan.injob import plan_in_job

        return plan_in_job(cfg, env, PROBE_STEPS)
    period = parse_duration(cfg.replan_every, "--replan-every") if cfg.replan_every else None
    if cfg.plan_budget == "auto":
        if period is None:
            return probe_and_train(cfg)
        cfg = dataclasses.replace(cfg, plan_budget=f"{REPLAN_SHARE * period}s")
    found = plan(cfg, Path(cfg.out) / PLAN_DIR)
    if found.winner is None:
        raise ShoalError(f"planning found no configuration that trains: see {cfg.out}/"
                         f"{PLAN_DIR}/plan.md")
    log.info(f"shoal: planned in {found.planning_s:.0f} s ({len(found.trials)} trials): "
             f"{found.why}")
    winner = dataclasses.replace(found.winner, overwrite=cfg.overwrite, progress=cfg.progress)
    summary = train(winner) if period is None else _train_replanning(cfg, found, period)
    if summary is not None:
        summary["plan"] = {"winner": found.trials[0].candidate.label(),
                           "planning_s": found.planning_s, "trials": len(found.trials),
                           "why": found.why}
        write_json(Path(cfg.out) / "summary.json", summary)
    return summary


def probe_and_train(cfg: TrainConfig) -> dict[str, Any] | None:
    """``--strategy auto --plan-budget auto``: train sync, timing its first
    :data:`PROBE_STEPS` steps (:mod:`shoal.train.probe`). Where a tenth of sync's predicted
    time pays for planning, the run stops there; the plan's trials start from its checkpoint
    with that tenth as their budget, and the winner (sync where no trial is predicted to
    reach the target) trains on from it. Otherwise the sync run goes on to its end. The
    summary's ``plan`` says which, with the probe's numbers."""
    PlanOptions.of(cfg)  # the planning settings, checked before anything trains
    out, launched = Path(cfg.out), time.time()
    started = cfg.plan_probe_since if cfg.plan_probe_since is not None else launched
    sync = dataclasses.replace(cfg, strategy="sync", strategy_options={}, plan_probe=PROBE_STEPS,
                               plan_probe_since=started)
    summary = train(sync)
    if summary is None:
        return None
    verdict = read_verdict(out, since=launched)
    if summary.get("stopped_by") != "probe":  # the run was sync's, to its end
        why = verdict["why"] if verdict is not None else (
            f"the run is shorter than sync's probe ({PROBE_STEPS} steps): planning skipped")
        if verdict is None:
            log.info(f"shoal: {why}")
        summary["plan"] = {"skipped": True, "why": why, "probe": verdict}
        write_json(out / "summary.json", summary)
        return summary
    if verdict is None:
        raise ShoalError(f"the probe stopped the run but left no decision in {out}")
    checkpoint = str(out / "checkpoint.pt")
    go_on = dataclasses.replace(cfg, init_from=checkpoint, init_progress=True,
                                plan_budget=f"{verdict['budget_s']}s")
    found = plan(go_on, out / PLAN_DIR, probe=verdict)
    winner, label, why = found.or_sync(dataclasses.replace(
        sync, plan_probe=None, plan_probe_since=None, init_from=checkpoint, init_progress=True))
    log.info(f"shoal: planned in {found.planning_s:.0f} s ({len(found.trials)} trials): {why}")
    summary = train(dataclasses.replace(winner, overwrite=False, progress=cfg.progress))
    if summary is not None:
        summary["plan"] = {"skipped": False, "winner": label, "planning_s": found.planning_s,
                           "trials": len(found.trials), "budget_s": verdict["budget_s"],
                           "why": why, "probe": verdict}
        write_json(out / "summary.json", summary)
    return summary


def _train_replanning(cfg: TrainConfig, found: Plan, period: float) -> dict[str, Any] | None:
    """Train ``found``'s winner for about ``period`` seconds (its trial's time per epoch
    says how many steps), re-plan from the checkpoint within :data:`REPLAN_SHARE` of the
    period, go on with the new winner from there (its evaluation model and position:
    ``--init-from --init-progress``); until the run's epochs are done. The summary adds
    ``segments`` (each one's winner, steps and wall time), ``replans`` and the planning and
    training times. A re-plan's time is added to the checkpoint's wall time, so the records'
    ``elapsed_s`` count it."""
    checkpoint = Path(cfg.out) / "checkpoint.pt"
    budget = min(parse_duration(cfg.plan_budget, "--plan-budget"), REPLAN_SHARE * period)
    go_on = dataclasses.replace(cfg, init_from=str(checkpoint), init_progress=True,
                                overwrite=cfg.overwrite, plan_budget=f"{budget}s")
    assert found.winner is not None and found.winner.global_batch_size is not None
    rows = len(load_dataset(cfg.dataset, data_options(cfg)).train)
    spe = EpochPlan(rows, found.winner.global_batch_size, 1, cfg.seed).steps_per_epoch
    total = cfg.epochs * spe
    segments: list[dict[str, Any]] = []
    replans: list[dict[str, Any]] = []
    first = at = start_of(cfg).step  # 0, or the user's --init-from --init-progress
    best, summary = found.trials[0], None
    while True:
        stop = _segment_end(at, max(1, round(period / best.epoch_s * spe)), spe, total)
        segment = dataclasses.replace(found.winner, progress=cfg.progress, stop_at_step=stop,
                                      overwrite=cfg.overwrite if at == first else False,
                                      **({} if at == first else {"init_from": str(checkpoint),
                                                                 "init_progress": True}))
        started = time.monotonic()
        summary = train(segment)
        if summary is None:
            return None
        segments.append({"winner": best.candidate.label(), "from_step": at,
                         "to_step": summary["steps"], "wall_s": time.monotonic() - started})
        if stop is None or summary.get("stopped_by"):
            break
        at = summary["steps"]
        entry, found, best = _replan_at(cfg, go_on, found, best, at, spe, budget,
                                        len(replans) + 1, segments[-1]["winner"])
        replans.append(entry)
    replanning = sum(r["planning_s"] for r in replans)
    training = sum(s["wall_s"] for s in segments)
    summary.update({"replan_every_s": period, "segments": segments, "replans": replans,
                    "replanning_s": replanning, "training_s": training,
                    "replan_overhead": replanning / training if training > 0 else None})
    return summary


def _segment_end(at: int, steps: int, spe: int, total: int) -> int | None:
    """Where a segment of ``steps`` steps from step ``at`` stops (``None``: the run's end)."""
    stop = at + steps
    if steps >= spe:  # a period of an epoch or more re-plans at an epoch's end (one step
        # past it, as a trial stops: the epoch's test and record are this segment's)
        stop = max(round(stop / spe) * spe + 1, at + 1)
    return None if stop + steps / 2 >= total else stop  # the last takes a remainder < half


def _replan_at(cfg: TrainConfig, go_on: TrainConfig, found: Plan, best: Any, at: int,
               spe: int, budget: float, k: int, previous: str) -> tuple[dict[str, Any], Plan, Any]:
    """The ``k``-th re-plan, from the checkpoint at step ``at``: its record, and the plan and
    best trial to go on with (the same ones when it is skipped or finds nothing better)."""
    out, checkpoint = Path(cfg.out), Path(cfg.out) / "checkpoint.pt"
    entry: dict[str, Any] = {"at_step": at, "at_epoch": at / spe, "budget_s": budget,
                             "dir": f"{PLAN_DIR}-{k}"}
    reached = start_of(go_on).accuracy >= (cfg.target_accuracy or math.inf)
    if reached or best.cost_s > budget:  # nothing to chase, or not one trial would fit
        entry.update(planning_s=0.0, trials=0, winner=best.candidate.label(), changed=False,
                     why="the run has reached the target" if reached else
                     f"a trial ({best.cost_s:.0f} s) does not fit the budget", skipped=True)
        return entry, found, best
    log.info(f"shoal: re-planning from step {at} (budget {budget:.0f} s)")
    started = time.monotonic()
    again = plan(go_on, out / entry["dir"], incumbent=best)
    took = time.monotonic() - started
    _add_wall_time(checkpoint, took)
    if again.winner is not None and again.trials[0].ok:
        found, best = again, again.trials[0]
    entry.update(planning_s=took, trials=len(again.trials), winner=best.candidate.label(),
                 changed=best.candidate.label() != previous, why=again.why)
    log.info(f"shoal: re-planned in {took:.0f} s: {again.why}")
    return entry, found, best


def _add_wall_time(checkpoint: Path, seconds: float) -> None:
    """Count ``seconds`` (a re-plan) in the run's wall time, as of ``checkpoint``."""
    payload = load_checkpoint(checkpoint)
    payload["progress"]["wall_time_s"] += seconds
    save_checkpoint(checkpoint, {k: v for k, v in payload.items()
                                 if k not in ("format", "version")})


__all__ = ["Plan", "PlanOptions", "Planner", "plan", "plan_and_train"]
