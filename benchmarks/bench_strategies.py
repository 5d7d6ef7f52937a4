"""The strategies side by side: sync against local-sgd, easgd and diloco at several tau.

Every configuration trains the same model on the same data with the same workers, batch and
epochs through `shoal train`; the table gives the median over repeats of samples/s (rank 0's
time inside training steps), the communication fraction, bytes sent per training sample (all
workers) and the final test accuracy, plus throughput relative to sync. Run:

    .venv/bin/python benchmarks/bench_strategies.py --workers 2 --epochs 10 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(strategy: str, tau: int | None, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "shoal", "train", "--strategy", strategy, "--model", a.model,
               "--dataset", a.dataset, "--workers", str(a.workers), "--epochs", str(a.epochs),
               "--batch-size", str(a.batch), "--progress", "none", "--out", out, *a.extra]
        if tau is not None:
            cmd += ["--tau", str(tau)]
        subprocess.run(cmd, check=True, cwd=REPO)
        return json.loads((Path(out) / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet5")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--strategies", default="local-sgd,easgd,diloco")
    p.add_argument("--taus", default="1,4,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write every run's numbers here")
    p.add_argument("extra", nargs="*", help="more `shoal train` flags (after --)")
    a = p.parse_args()
    configs = [("sync", None)] + [(s, int(t)) for s in a.strategies.split(",")
                                  for t in a.taus.split(",")]
    rows = []
    for strategy, tau in configs:
        runs = [run(strategy, tau, a) for _ in range(a.repeats)]
        keys = ("samples_per_s", "comm_fraction", "bytes_per_sample", "test_accuracy")
        rows.append({"strategy": strategy, "tau": tau, "runs": runs,
                     **{k: statistics.median(r[k] for r in runs) for k in keys}})
        print(f"{strategy} tau={tau}: {rows[-1]['samples_per_s']:,.0f} samples/s", file=sys.stderr)
    sync = rows[0]["samples_per_s"]
    print(f"\n{a.model} on {a.dataset}, {a.workers} workers, batch {a.batch}/worker, "
          f"{a.epochs} epochs, median of {a.repeats}\n")
    print("| strategy | tau | samples/s | vs sync | comm fraction | bytes/sample | test accuracy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['strategy']} | {r['tau'] or '-'} | {r['samples_per_s']:,.0f} | "
              f"{r['samples_per_s'] / sync:.2f} | {100 * r['comm_fraction']:.1f}% | "
              f"{r['bytes_per_sample']:,.0f} | {100 * r['test_accuracy']:.1f}% |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
