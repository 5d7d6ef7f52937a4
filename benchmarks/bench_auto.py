"""``shoal train --strategy auto`` with its default budget (``--plan-budget auto``: sync's
probe, then planning for a tenth of sync's predicted time, or none) against ``--strategy
sync``, end to end: every start-up, the probe and the planning included.

Each repeat runs sync, then auto, one after the other on the same workers or hosts. Locally
both are the ``shoal train`` command a user runs (a subprocess each); on an emulated
cluster (``--emulate-bandwidth``) each is that command under torchrun across its hosts, so
auto's probe, plan and winner run on the job's own ranks (planning inside the job). Times
are wall-clock from the command's start: to the target (the job's last records give how
long it trained after reaching it) and to its end. Writes ``bench_auto.json`` and prints a
table::

    .venv/bin/python benchmarks/bench_auto.py --task digits --repeats 3
    sudo .venv/bin/python benchmarks/bench_auto.py --task hard --emulate-bandwidth 100mbit --repeats 3
    sudo .venv/bin/python benchmarks/bench_auto.py --task hard --emulate-bandwidth 100mbit \
        --emulate-slow 1:0.25 --repeats 3   # host 1 at a quarter of a core
    sudo .venv/bin/python benchmarks/bench_auto.py --task hard --emulate-bandwidth 100mbit \
        --workers 4 --emulate-slow 1:0.125 --plan-candidates sync,local-sgd,groups,async-measgd
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_plan import TASKS

from shoal.config import TrainConfig
from shoal.core.files import read_records
from shoal.core.hostspec import slow_hosts
from shoal.emulate import terminate_as_exception
from shoal.sweep.runner import Launcher


def to_target(out: Path, target: float, wall_s: float) -> float:
    """Seconds from a command's start to the first test at ``target`` or above (``inf``:
    never): its wall time less what its last job trained after that test."""
    records = read_records(out / "metrics.jsonl", "run's records")
    tested = [r for r in records if r["event"] == "epoch" and r.get("test_accuracy") is not None]
    hit = next((r for r in tested if r["test_accuracy"] >= target), None)
    if hit is None:
        return math.inf
    return wall_s - (float(records[-1]["elapsed_s"]) - float(hit["elapsed_s"]))


def local_command(cfg: TrainConfig, workers: int) -> float:
    """``shoal train --config`` (``cfg``) as a user runs it; its wall time."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{out.name}.json"
    config.write_text(json.dumps(cfg.to_dict()))
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "shoal", "train", "--config", str(config),
                          "--workers", str(workers)], capture_output=True, text=True,
                         timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"{out.name} failed: {res.stderr.strip().splitlines()[-1:]}")
    return time.monotonic() - started


def emulated_command(launcher: Launcher, cfg: TrainConfig, workers: int) -> float:
    """``shoal train --config`` (``cfg``) under torchrun across ``workers`` emulated hosts
    (sync and auto start no servers); its wall time."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{out.name}.json"
    config.write_text(json.dumps(dataclasses.replace(cfg, workers=workers).to_dict()))
    started = time.monotonic()
    launcher.train(["--config", str(config)], workers, workers, out, out.name)
    return time.monotonic() - started


def run_pair(base: TrainConfig, launcher: Launcher, workers: int, root: Path,
             r: int) -> dict[str, Any]:
    """One repeat: sync, then auto; their times and what auto decided."""
    sync = dataclasses.replace(base, strategy="sync", out=str(root / f"sync-r{r}"))
    auto = dataclasses.replace(base, strategy="auto", out=str(root / f"auto-r{r}"))
    if launcher.emulate_bandwidth is None:
        sync_wall, auto_wall = local_command(sync, workers), local_command(auto, workers)
    else:
        sync_wall, auto_wall = (emulated_command(launcher, cfg, workers) for cfg in (sync, auto))
    target = float(base.target_accuracy or 1.0)
    summary = json.loads((Path(auto.out) / "summary.json").read_text())
    plan = summary.get("plan", {})
    row = {"repeat": r, "sync_wall_s": sync_wall, "auto_wall_s": auto_wall,
           "sync_s": to_target(Path(sync.out), target, sync_wall),
           "auto_s": to_target(Path(auto.out), target, auto_wall),
           "auto_final": summary["test_accuracy"], "planned": not plan.get("skipped", True),
           "winner": plan.get("winner", "sync"), "planning_s": plan.get("planning_s", 0.0),
           "budget_s": (plan.get("probe") or {}).get("budget_s")}
    row["speedup"] = row["sync_s"] / row["auto_s"] if math.isfinite(row["auto_s"]) else 0.0
    row["speedup_wall"] = sync_wall / auto_wall
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(TASKS), default="digits")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--emulate-bandwidth", default=None, metavar="RATE")
    p.add_argument("--emulate-slow", default=None, metavar="HOST:FRACTION[,...]",
                   help="uneven hosts (with --emulate-bandwidth): 1:0.25 holds host 1 to a "
                        "quarter of a core")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plan-candidates", default=None, metavar="S[,S...]",
                   help="auto's candidates (default: its own)")
    p.add_argument("--samples", type=int, default=None, help="a synthetic task's samples")
    p.add_argument("--epochs", type=int, default=None, help="override the task's epochs")
    p.add_argument("--target", type=float, default=None, help="override the task's target")
    p.add_argument("--out", default="runs/bench-auto")
    args = p.parse_args()
    settings = dict(TASKS[args.task])
    for key, value in (("synthetic_samples", args.samples), ("epochs", args.epochs),
                       ("target_accuracy", args.target),
                       ("plan_candidates", args.plan_candidates
                        and tuple(args.plan_candidates.split(",")))):
        if value is not None:
            settings[key] = value
    base = TrainConfig(**settings, threads_per_worker=1, progress="none", overwrite=True)
    root = Path(args.out).resolve() / "-".join(
        str(v) for v in (args.task, args.samples, args.epochs, args.emulate_bandwidth, args.workers,
                         args.emulate_slow and "slow" + args.emulate_slow.replace(":", "-"))
        if v)
    rows = []
    slow = slow_hosts(args.emulate_slow) if args.emulate_slow else {}
    with terminate_as_exception(), Launcher(args.emulate_bandwidth, timeout=3600,
                                            slow=slow) as launcher:
        for r in range(args.repeats):
            rows.append(run_pair(base, launcher, args.workers, root, r))
            print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()
    summary = {"task": args.task, "settings": {k: list(v) if isinstance(v, tuple) else v
                                               for k, v in settings.items()},
               "workers": args.workers, "emulate_bandwidth": args.emulate_bandwidth,
               "emulate_slow": args.emulate_slow,
               "rows": rows, "load_average": load,
               "median_speedup": statistics.median(r["speedup"] for r in rows)}
    (root / "bench_auto.json").write_text(json.dumps(summary, indent=2))
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("sync_s", "auto_s", "sync_wall_s", "auto_wall_s", "speedup", "speedup_wall")}
    print(f"\nsync to target {med['sync_s']:.1f} s (end {med['sync_wall_s']:.1f} s); auto "
          f"{med['auto_s']:.1f} s (end {med['auto_wall_s']:.1f} s); median speed-up "
          f"{med['speedup']:.2f}x to the target, {med['speedup_wall']:.2f}x to the end; "
          f"planned in {sum(r['planned'] for r in rows)} of {len(rows)}: "
          f"{', '.join(sorted({r['winner'] for r in rows}))}; load {load[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
