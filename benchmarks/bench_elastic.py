"""An ``--elastic`` job's training speed, this tree against another revision of shoal
(``--baseline DIR``: a checkout of it), run in turn: did a change to membership's code cost
the loop anything?

Each repeat runs, for every strategy asked for, ``shoal train --elastic --workers N`` once
from each tree (this one and the baseline, alternating which goes first), LeNet-5 on
digits; it reads ``samples_per_s`` and ``train_time_s`` from the run's summary.json and
times the whole command. The table gives the medians and the ratio of this tree's samples/s
to the baseline's. Run it on a quiet machine:

    git worktree add /tmp/before <rev>
    .venv/bin/python benchmarks/bench_elastic.py --baseline /tmp/before --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_run(tree: Path, strategy: str, workers: int, epochs: int) -> dict[str, float]:
    """One ``shoal train --elastic`` of ``tree``'s shoal: its samples/s, its training time
    and the command's whole wall time."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        args = [sys.executable, "-m", "shoal", "train", "--elastic", "--strategy", strategy,
                "--workers", str(workers), "--epochs", str(epochs), "--model", "lenet5",
                "--dataset", "digits", "--progress", "none", "--out", str(out)]
        began = time.monotonic()
        done = subprocess.run(args, env=env, cwd=tree, capture_output=True, text=True,
                              timeout=600)
        wall = time.monotonic() - began
        if done.returncode != 0:
            raise SystemExit(f"{tree}: {strategy} failed:\n{done.stderr}")
        summary = json.loads((out / "summary.json").read_text())
    return {"samples_per_s": summary["samples_per_s"], "train_s": summary["train_time_s"],
            "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="a checkout of the other rev")
    p.add_argument("--strategies", default="sync,async-easgd")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write every run's numbers here")
    args = p.parse_args()
    trees = {"this": REPO, "baseline": args.baseline.resolve()}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        s: {name: [] for name in trees} for s in args.strategies.split(",")}
    for repeat in range(args.repeats):
        order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
        for strategy, by_tree in runs.items():
            for name in order:
                by_tree[name].append(one_run(trees[name], strategy, args.workers,
                                             args.epochs))
    print(f"{'strategy':<14}{'tree':<10}{'samples/s':>11}{'train s':>9}{'wall s':>8}"
          f"{'ratio':>8}")
    for strategy, by_tree in runs.items():
        med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for name, rs in by_tree.items()}
        for name in trees:
            ratio = med[name]["samples_per_s"] / med["baseline"]["samples_per_s"]
            print(f"{strategy:<14}{name:<10}{med[name]['samples_per_s']:>11,.0f}"
                  f"{med[name]['train_s']:>9.2f}{med[name]['wall_s']:>8.2f}{ratio:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
