"""An asynchronous job's throughput through `shoal train`, with real servers and workers.

Each repeat trains the same model on the same data with the same workers; its throughput is
the samples between its first and its last epoch record over the time between them (server
0 records an epoch once every worker reported it), so the processes' start-up and the first
epoch's warm-up do not count. With ``--trees``, each repeat runs the job once with each
source tree in turn (``PYTHONPATH`` on it: a version unpacked with ``git archive``), so that
two versions are measured alternately under the same load. Each line gives a tree's median
and range. Run:

    .venv/bin/python benchmarks/bench_async.py --strategy async-sgd --workers 2 --repeats 5
    git archive main | tar -x -C /tmp/old
    .venv/bin/python benchmarks/bench_async.py --trees /tmp/old . --repeats 5
    .venv/bin/python benchmarks/bench_async.py --strategy groups --workers 4 \
        --flags "--groups 2 --elastic" --trees /tmp/old . --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(a: argparse.Namespace, tree: Path) -> float:
    """One job's samples/s after its first epoch, with shoal from the source tree ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "shoal", "train", "--strategy", a.strategy,
                        "--model", a.model, "--dataset", a.dataset, "--workers", str(a.workers),
                        "--epochs", str(a.epochs), "--batch-size", str(a.batch),
                        "--progress", "none", "--out", out, *shlex.split(a.flags)],
                       check=True, cwd=tree, env=env)
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text()
                   .splitlines()]
        summary = json.loads((Path(out) / "summary.json").read_text())
    epochs = [r for r in records if r["event"] == "epoch"]
    first, last = epochs[0], epochs[-1]
    per_epoch = summary["samples"] / summary["epochs"]
    return (last["epoch"] - first["epoch"]) * per_epoch / (last["elapsed_s"] - first["elapsed_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="async-sgd")
    p.add_argument("--model", default="mlp")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flags", default="", help="more flags of shoal train, e.g. "
                   "'--groups 2 --elastic'")
    p.add_argument("--trees", nargs="+", type=Path, default=[REPO],
                   help="source trees of shoal to alternate (default: this one)")
    a = p.parse_args()
    trees = [t.resolve() for t in a.trees]
    runs: dict[Path, list[float]] = {t: [] for t in trees}
    for k in range(a.repeats):
        for tree in trees:
            runs[tree].append(run(a, tree))
            print(f"repeat {k + 1}, {tree}: {runs[tree][-1]:,.0f} samples/s", flush=True)
    for tree, rates in runs.items():
        print(f"{tree}: {a.strategy} {a.flags}, {a.model} on {a.dataset}, {a.workers} workers, batch "
              f"{a.batch}/worker: {statistics.median(rates):,.0f} samples/s (median of "
              f"{a.repeats}; {min(rates):,.0f}-{max(rates):,.0f}; runs "
              f"{', '.join(f'{r:,.0f}' for r in rates)})")


if __name__ == "__main__":
    main()
