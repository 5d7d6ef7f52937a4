"""The planner's pick against the best configuration of an exhaustive grid, in the same run.

``shoal plan`` measures a few configurations for a trial's epochs and predicts the rest;
this benchmark trains **every** configuration of the space the planner searches to the end
(the families sync, local-sgd, easgd, diloco at tau 4, 16, 64 and groups at every g, each at
every point of Omnivore's grid: momentum 0, 0.3, 0.6, 0.9 x learning rate lr, lr/10), takes
each one's measured time to the target (training time, the records' ``elapsed_s``), and
compares the plan's winner, trained the same way, with the grid's best. Omnivore's claim,
and the goal here: the pick is within 10% of the best. Writes ``bench_plan_grid.json``::

    sudo .venv/bin/python benchmarks/bench_plan_grid.py --task digits --emulate-bandwidth 100mbit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from bench_plan import TASKS, add_task_args

from shoal.config import TrainConfig
from shoal.emulate import terminate_as_exception
from shoal.plan import plan
from shoal.plan.planner import run_config
from shoal.plan.search import MOMENTA, RATE_FACTORS, TAUS, group_knobs
from shoal.sweep.measure import measure_race
from shoal.sweep.runner import Launcher

FAMILIES = ("local-sgd", "easgd", "diloco")


def grid(base: TrainConfig, workers: int) -> list[tuple[str, dict[str, int], float, float]]:
    """Every (strategy, options, momentum, lr) the planner's search space holds."""
    shapes: list[tuple[str, dict[str, int]]] = [("sync", {})]
    shapes += [(name, {"tau": tau}) for name in FAMILIES for tau in TAUS]
    shapes += [("groups", {"groups": g}) for g in group_knobs(workers)[1:]]
    return [(name, opts, mu, base.lr * f) for name, opts in shapes
            for f in RATE_FACTORS for mu in MOMENTA]


def label(name: str, opts: dict[str, int], mu: float, lr: float) -> str:
    knob = ",".join(f"{k}={v}" for k, v in opts.items())
    return f"{name}{':' + knob if knob else ''} mu={mu:g} lr={lr:g}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_task_args(p)
    p.add_argument("--out", default="runs/bench-plan-grid")
    args = p.parse_args()
    settings = dict(TASKS[args.task])
    target = settings["target_accuracy"]
    base = TrainConfig(**settings, threads_per_worker=1, plan_budget=args.budget,
                       progress="none", workers=args.workers, overwrite=True).validate()
    root = Path(args.out).resolve() / args.task
    rows: list[dict] = []
    # SIGTERM unwinds through the launcher, which tears its emulated clusters down.
    with terminate_as_exception(), Launcher(args.emulate_bandwidth, timeout=3600) as launcher:
        found = plan(dataclasses.replace(base, out=str(root / "plan")), launcher=launcher)
        if found.winner is None:
            print(f"the planner picked nothing: {found.why}", file=sys.stderr)
            return 1
        w = found.winner
        pick = label(w.strategy, {k: int(v) for k, v in w.strategy_options.items()
                                  if k in ("tau", "groups")}, float(w.momentum), w.lr)
        print(f"plan: {found.trials[0].candidate.label()} ({found.planning_s:.0f} s, "
              f"{len(found.trials)} trials)", flush=True)
        for i, (name, opts, mu, lr) in enumerate(grid(base, args.workers)):
            cfg = dataclasses.replace(base, strategy=name, strategy_options=dict(opts),
                                      momentum=mu, lr=lr, workers=None,
                                      nesterov=base.nesterov and mu != 0,
                                      out=str(root / "grid" / f"{i:02d}"))
            row = {"config": label(name, opts, mu, lr), "time_to_target": math.inf,
                   "final_accuracy": None, "error": None}
            try:
                run_config(launcher, cfg, args.workers, f"grid-{i:02d}")
                r = measure_race(Path(cfg.out), target)
                row.update(time_to_target=r["time_to_target"],
                           final_accuracy=r["final_accuracy"])
            except Exception as exc:  # a diverging grid point is a result, not a failure
                row["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            rows.append(row)
            print(json.dumps(row), flush=True)
    reached = [r for r in rows if math.isfinite(r["time_to_target"])]
    best = min(reached, key=lambda r: r["time_to_target"]) if reached else None
    picked = next((r for r in rows if r["config"] == pick), None)
    ratio = (picked["time_to_target"] / best["time_to_target"]
             if best is not None and picked is not None else math.inf)
    ranked = sorted(rows, key=lambda r: r["time_to_target"])
    summary = {"task": args.task, "workers": args.workers,
               "emulate_bandwidth": args.emulate_bandwidth, "budget": args.budget,
               "target_accuracy": target, "planning_s": found.planning_s,
               "plan_trials": len(found.trials), "pick": pick,
               "pick_time_to_target": picked["time_to_target"] if picked else None,
               "best": best["config"] if best else None,
               "best_time_to_target": best["time_to_target"] if best else None,
               "pick_over_best": ratio,
               "pick_rank": next((i + 1 for i, r in enumerate(ranked) if r["config"] == pick),
                                 None),
               "grid": [{**r, "time_to_target": _finite(r["time_to_target"])} for r in rows]}
    (root / "bench_plan_grid.json").write_text(json.dumps(summary, indent=2))
    print(f"\n| rank | configuration | time to {100 * target:g}% (s) | final accuracy |")
    print("|---:|---|---:|---:|")
    for i, r in enumerate(ranked[:10]):
        mark = " (the plan's pick)" if r["config"] == pick else ""
        acc = f"{100 * r['final_accuracy']:.1f}%" if r["final_accuracy"] is not None else "-"
        print(f"| {i + 1} | {r['config']}{mark} | {_s(r['time_to_target'])} | {acc} |")
    print(f"\n{len(reached)}/{len(rows)} configurations reached {100 * target:g}%; the plan's "
          f"pick {pick} ranks {summary['pick_rank']}, {ratio:.2f}x the best's time "
          f"(goal: within 1.10x); planning took {found.planning_s:.0f} s")
    return 0


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _s(v: float) -> str:
    return f"{v:.2f}" if math.isfinite(v) else "never"


if __name__ == "__main__":
    sys.exit(main())
