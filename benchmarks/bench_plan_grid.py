"""The planner's pick against the best configuration of an exhaustive grid, in the same run.

``shoal plan`` measures a few configurations for a trial's epochs and predicts the rest;
this benchmark trains **every** configuration of the space the planner searches to the end
(the families sync, local-sgd, easgd, diloco at tau 4, 16, 64 and groups at every g, each at
every point of Omnivore's grid: momentum 0, 0.3, 0.6, 0.9 x learning rate lr, lr/10), takes
each one's measured time to the target (training time, the records' ``elapsed_s``), and
compares the plan's winner, trained the same way, with the grid's best. Omnivore's claim,
and the goal here: the pick is within 10% of the best.

With ``--repeats R`` the planning and the whole grid run R times; a configuration's time
is the median of its R runs, and each repeat's pick is compared with the best median. The
synchronous grid points train one after another in one planning session of workers
(``shoal.plan.session``: the same processes, a fresh model each), the ``groups`` points as
jobs of their own. Writes ``bench_plan_grid.json``::

    sudo .venv/bin/python benchmarks/bench_plan_grid.py --task digits --emulate-bandwidth 100mbit \
        --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from bench_plan import TASKS, add_task_args

from shoal.config import TrainConfig
from shoal.core.failures import first_line
from shoal.emulate import terminate_as_exception
from shoal.plan import plan
from shoal.plan.planner import run_config
from shoal.plan.search import MOMENTA, RATE_FACTORS, TAUS, group_knobs
from shoal.plan.session import PlanningSession
from shoal.sweep.measure import measure_race
from shoal.sweep.runner import Launcher

FAMILIES = ("local-sgd", "easgd", "diloco")


def grid(base: TrainConfig, workers: int) -> list[tuple[str, dict[str, int], float, float]]:
    """Every (strategy, options, momentum, lr) the planner's search space holds."""
    shapes: list[tuple[str, dict[str, int]]] = [("sync", {})]
    shapes += [(name, {"tau": tau}) for name in FAMILIES for tau in TAUS]
    shapes += [("groups", {"groups": g}) for g in group_knobs(workers)[1:]]
    return [(name, opts, mu, base.base_lr(1) * f) for name, opts in shapes
            for f in RATE_FACTORS for mu in MOMENTA]


def label(name: str, opts: dict[str, int], mu: float, lr: float) -> str:
    knob = ",".join(f"{k}={v}" for k, v in opts.items())
    return f"{name}{':' + knob if knob else ''} mu={mu:g} lr={lr:g}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_task_args(p)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default="runs/bench-plan-grid")
    args = p.parse_args()
    settings = dict(TASKS[args.task])
    target = settings["target_accuracy"]
    base = TrainConfig(**settings, threads_per_worker=1, plan_budget=args.budget,
                       progress="none", workers=args.workers, overwrite=True).validate()
    root = Path(args.out).resolve() / args.task
    points = grid(base, args.workers)
    times: dict[str, list[float]] = {label(*point): [] for point in points}
    finals: dict[str, list[float]] = {label(*point): [] for point in points}
    picks: list[dict] = []
    # SIGTERM unwinds through the launcher, which tears its emulated clusters down.
    with terminate_as_exception(), Launcher(args.emulate_bandwidth, timeout=3600) as launcher:
        for r in range(args.repeats):
            found = plan(dataclasses.replace(base, out=str(root / f"plan-r{r}")), launcher=launcher)
            if found.winner is None:
                print(f"the planner picked nothing: {found.why}", file=sys.stderr)
                return 1
            w = found.winner
            picks.append({"repeat": r, "pick": label(w.strategy, {k: int(v) for k, v in
                                                                  w.strategy_options.items()
                                                                  if k in ("tau", "groups")},
                                                     float(w.momentum), w.lr),
                          "planning_s": found.planning_s, "trials": len(found.trials)})
            print(f"plan {r}: {found.trials[0].candidate.label()} ({found.planning_s:.0f} s, "
                  f"{len(found.trials)} trials)", flush=True)
            session = PlanningSession(launcher, base, args.workers, root / f"sessions-r{r}", 3600)
            try:
                for i, point in enumerate(points):
                    row = run_point(launcher, session, base, point,
                                    root / f"grid-r{r}" / f"{i:02d}", args.workers, target)
                    times[row["config"]].append(row["time_to_target"])
                    if row["final_accuracy"] is not None:
                        finals[row["config"]].append(row["final_accuracy"])
                    print(json.dumps({"repeat": r, **row}), flush=True)
            finally:
                session.close()
    median = {k: statistics.median(v) for k, v in times.items()}
    ranked = sorted(median, key=lambda k: median[k])
    best = ranked[0] if math.isfinite(median[ranked[0]]) else None
    for pk in picks:
        pk["median_time_to_target"] = _finite(median.get(pk["pick"], math.inf))
        pk["over_best"] = _finite(median.get(pk["pick"], math.inf) / median[best]) if best else None
        pk["rank"] = ranked.index(pk["pick"]) + 1 if pk["pick"] in ranked else None
    summary = {"task": args.task, "workers": args.workers, "repeats": args.repeats,
               "emulate_bandwidth": args.emulate_bandwidth, "budget": args.budget,
               "target_accuracy": target, "picks": picks, "best": best,
               "best_time_to_target": median[best] if best else None,
               "grid": [{"config": k, "times": [_finite(t) for t in times[k]],
                         "median_time_to_target": _finite(median[k]),
                         "final_accuracy": statistics.median(finals[k]) if finals[k] else None}
                        for k in ranked]}
    (root / "bench_plan_grid.json").write_text(json.dumps(summary, indent=2))
    chosen = {pk["pick"] for pk in picks}
    print(f"\n| rank | configuration | median time to {100 * target:g}% (s) | runs | final accuracy |")
    print("|---:|---|---:|---|---:|")
    for i, k in enumerate(ranked):
        if i >= 10 and k not in chosen:
            continue
        mark = " (a plan's pick)" if k in chosen else ""
        acc = f"{100 * statistics.median(finals[k]):.1f}%" if finals[k] else "-"
        runs = ", ".join(_s(t) for t in times[k])
        print(f"| {i + 1} | {k}{mark} | {_s(median[k])} | {runs} | {acc} |")
    reached = sum(math.isfinite(v) for v in median.values())
    print(f"\n{reached}/{len(median)} configurations reached {100 * target:g}% (median of "
          f"{args.repeats}); best {best}")
    for pk in picks:
        print(f"plan {pk['repeat']}: {pk['pick']} ranks {pk['rank']}, "
              f"{pk['over_best'] or math.inf:.2f}x the best's time (goal: within 1.10x); "
              f"planning took {pk['planning_s']:.0f} s, {pk['trials']} trials")
    return 0


def run_point(launcher: Launcher, session: PlanningSession, base: TrainConfig,
              point: tuple[str, dict[str, int], float, float], out: Path, workers: int,
              target: float) -> dict:
    """Train one grid point to the end (in ``session`` when it is synchronous); its time to
    ``target`` (training time) and final accuracy, or its error."""
    name, opts, mu, lr = point
    cfg = dataclasses.replace(base, strategy=name, strategy_options=dict(opts), momentum=mu,
                              lr=lr, workers=None, nesterov=base.nesterov and mu != 0,
                              out=str(out))
    row = {"config": label(*point), "time_to_target": math.inf, "final_accuracy": None,
           "error": None}
    try:
        if name == "groups":
            run_config(launcher, cfg, workers, out.name)
        else:
            out.mkdir(parents=True, exist_ok=True)
            session.run(cfg)
        r = measure_race(out, target)
        row.update(time_to_target=r["time_to_target"], final_accuracy=r["final_accuracy"])
    except Exception as exc:  # a diverging grid point is a result, not a failure
        row["error"] = first_line(exc)
    return row


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _s(v: float) -> str:
    return f"{v:.2f}" if math.isfinite(v) else "never"


if __name__ == "__main__":
    sys.exit(main())
