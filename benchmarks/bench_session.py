"""A planning session's time per trial: how long the planner waits for a trial of one step,
its command's way to the workers and their answers' way back included. Prints a markdown
table. Run:

    .venv/bin/python benchmarks/bench_session.py --workers 2 --trials 30
    sudo .venv/bin/python benchmarks/bench_session.py --workers 2 --trials 30 --emulate-bandwidth 1gbit

Each trial trains the digits MLP for one step in a fresh output folder (the planner's short
trials, at their shortest), one after another in one session (:mod:`shoal.plan.session`);
the first trial's wait includes the session's start-up and is listed apart. What a trial
does is the same whatever carries the commands, so the difference between two versions of
shoal measured this way is the difference in how commands and answers travel.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

from shoal.config import TrainConfig
from shoal.emulate import terminate_as_exception
from shoal.plan.session import PlanningSession
from shoal.sweep.runner import Launcher


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--emulate-bandwidth", default=None, help="run on an emulated cluster (root)")
    a = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {len(os.sched_getaffinity(0))} cores\n")
    with tempfile.TemporaryDirectory(prefix="bench-session-") as tmp:
        root = Path(tmp)
        base = TrainConfig(model="mlp", dataset="digits", epochs=1, batch_size=64, workers=a.workers,
                           threads_per_worker=1, progress="none", out=str(root / "base")).validate()
        waits = []
        with terminate_as_exception(), Launcher(a.emulate_bandwidth, timeout=600) as launcher:
            session = PlanningSession(launcher, base, a.workers, root / "sessions", timeout=600)
            try:
                for k in range(a.trials + 1):
                    cfg = dataclasses.replace(base, out=str(root / f"trial-{k}"), workers=None,
                                              stop_at_step=1, eval_every_steps=None)
                    started = time.perf_counter()
                    session.run(cfg)
                    waits.append(time.perf_counter() - started)
            finally:
                session.close()
    where = f"emulated cluster at {a.emulate_bandwidth}" if a.emulate_bandwidth else "this machine"
    print(f"### A planning session of {a.workers} workers on {where}, {a.trials} trials of one step\n")
    print("| first trial, with the session's start-up (s) | trial, median (s) | fastest (s) | slowest (s) |")
    print("| ---: | ---: | ---: | ---: |")
    rest = waits[1:]
    print(f"| {waits[0]:.2f} | {statistics.median(rest):.3f} | {min(rest):.3f} | {max(rest):.3f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
