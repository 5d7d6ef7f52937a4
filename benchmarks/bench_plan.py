"""Time to a target accuracy: ``shoal train --strategy auto`` (planning included) against
``sync``, in the same run, locally or on an emulated cluster.

Each repeat trains ``sync`` to the end of the run's epochs, then plans (Omnivore's search,
``shoal.plan.plan``, its trials on the same workers or hosts) and trains the plan's winner;
both runs are tested after every epoch. auto's time to the target is the planning time plus
the winner's training time to the target; sync's is its training time to the target (both
from the records' ``elapsed_s``: process start-up of the final runs excluded, the trials'
start-ups included in the planning time). Writes ``bench_plan.json`` and prints a table::

    sudo .venv/bin/python benchmarks/bench_plan.py --task digits --emulate-bandwidth 100mbit
    sudo .venv/bin/python benchmarks/bench_plan.py --task hard --emulate-bandwidth 100mbit
    sudo .venv/bin/python benchmarks/bench_plan.py --task hard --samples 16384 --target 0.75 \
        --emulate-bandwidth 100mbit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from shoal.config import TrainConfig
from shoal.emulate import terminate_as_exception
from shoal.plan import plan
from shoal.plan.planner import run_config
from shoal.sweep.measure import measure_race
from shoal.sweep.runner import Launcher

#: The runs: LeNet-5 on the bundled digits (trains in seconds: planning cannot pay for
#: itself), and a communication-bound task (an MLP of 1.1M parameters, 4.4 MB a gradient, on
#: noisy 8x8 synthetic data whose best accuracy is about 75%: sync spends most of an epoch
#: in all-reduces on a slow link, so the plan's choice matters).
TASKS = {
    "digits": dict(model="lenet5", dataset="digits", epochs=15, batch_size=16, lr=0.05,
                   momentum=0.9, schedule="cosine", target_accuracy=0.95),
    "hard": dict(model="benchmarks/models.py:mlp_1024x2", dataset="synthetic",
                 synthetic_shape=(1, 8, 8), synthetic_samples=4096, synthetic_noise=3.0,
                 epochs=8, batch_size=32, lr=0.05, momentum=0.9, schedule="cosine",
                 target_accuracy=0.74),
}


def add_task_args(p: argparse.ArgumentParser) -> None:
    """The flags every planning benchmark takes: the task, the cluster, the budget."""
    p.add_argument("--task", choices=sorted(TASKS), default="digits")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--emulate-bandwidth", default=None, metavar="RATE")
    p.add_argument("--budget", default="2m", help="planning budget (default 2m)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_task_args(p)
    p.add_argument("--trial-epochs", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--target", type=float, default=None, help="override the task's target")
    p.add_argument("--samples", type=int, default=None,
                   help="override a synthetic task's training samples (more: a longer run)")
    p.add_argument("--epochs", type=int, default=None, help="override the task's epochs")
    p.add_argument("--out", default="runs/bench-plan")
    args = p.parse_args()
    settings = dict(TASKS[args.task])
    if args.target is not None:
        settings["target_accuracy"] = args.target
    if args.samples is not None:
        settings["synthetic_samples"] = args.samples
    if args.epochs is not None:
        settings["epochs"] = args.epochs
    target = settings["target_accuracy"]
    base = TrainConfig(**settings, threads_per_worker=1, plan_budget=args.budget,
                       trial_epochs=args.trial_epochs, progress="none", workers=args.workers,
                       overwrite=True).validate()
    root = Path(args.out).resolve() / (args.task if args.samples is None
                                       else f"{args.task}-{args.samples}")
    rows = []
    # SIGTERM unwinds through the launcher, which tears its emulated clusters down.
    with terminate_as_exception(), Launcher(args.emulate_bandwidth, timeout=3600) as launcher:
        for r in range(args.repeats):
            sync = dataclasses.replace(base, strategy="sync", workers=None,
                                       out=str(root / f"sync-r{r}"))
            run_config(launcher, sync, args.workers, f"sync-r{r}")
            s = measure_race(Path(sync.out), target)
            found = plan(dataclasses.replace(base, out=str(root / f"plan-r{r}")),
                         launcher=launcher)
            winner = dataclasses.replace(found.winner, out=str(root / f"auto-r{r}"))
            run_config(launcher, winner, found.trials[0].candidate.workers, f"auto-r{r}")
            a = measure_race(Path(winner.out), target)
            auto_s = found.planning_s + a["time_to_target"]
            rows.append({"repeat": r, "sync_s": s["time_to_target"],
                         "sync_final": s["final_accuracy"], "planning_s": found.planning_s,
                         "trials": len(found.trials), "winner": found.trials[0].candidate.label(),
                         "winner_s": a["time_to_target"], "winner_final": a["final_accuracy"],
                         "auto_s": auto_s, "speedup": s["time_to_target"] / auto_s})
            print(json.dumps(rows[-1]), flush=True)
    summary = {"task": args.task, "settings": {k: list(v) if isinstance(v, tuple) else v
                                               for k, v in settings.items()},
               "workers": args.workers, "emulate_bandwidth": args.emulate_bandwidth,
               "budget": args.budget, "rows": rows,
               "median_speedup": statistics.median(r["speedup"] for r in rows)}
    (root / "bench_plan.json").write_text(json.dumps(summary, indent=2))
    print(f"\n| repeat | sync to {100 * target:g}% (s) | planning (s) | winner | winner to "
          f"{100 * target:g}% (s) | auto total (s) | speed-up |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['repeat']} | {_s(row['sync_s'])} | {row['planning_s']:.1f} | "
              f"{row['winner']} | {_s(row['winner_s'])} | {_s(row['auto_s'])} | "
              f"{row['speedup']:.2f}x |")
    print(f"median speed-up {summary['median_speedup']:.2f}x; wrote {root / 'bench_plan.json'}")
    return 0


def _s(v: float) -> str:
    return f"{v:.1f}" if math.isfinite(v) else "never"


if __name__ == "__main__":
    sys.exit(main())
