"""A small job's whole time and CPU, its workers forked from a server that imported torch
once (shoal's default on Linux) against fresh interpreters (``SHOAL_START_METHOD=spawn``).

Each repeat runs ``shoal train --dataset digits --model mlp --epochs 1`` once each way, in
turn, for every strategy and worker count asked for; it times the whole command (start-up
included: that is what is measured) and the whole machine's CPU over it (``/proc/stat``,
so the fork server's own import counts; run it on a quiet machine). Each line gives the
medians and the ratio spawn / forkserver. Run:

    .venv/bin/python benchmarks/bench_start.py --strategies sync,local-sgd --workers 2,4 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = ("spawn", "forkserver")


def _cpu_ticks() -> int:
    """The machine's busy CPU time so far (user, nice, system, irq, softirq), in ticks."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6))


def run(method: str, strategy: str, workers: int) -> tuple[float, float]:
    """One job's wall time and the machine's CPU seconds over it."""
    env = {**os.environ, "SHOAL_START_METHOD": method, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory() as out:
        ticks, began = _cpu_ticks(), time.monotonic()
        subprocess.run([sys.executable, "-m", "shoal", "train", "--dataset", "digits",
                        "--model", "mlp", "--workers", str(workers), "--epochs", "1",
                        "--strategy", strategy, "--progress", "none", "--out", out],
                       check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - began
        cpu = (_cpu_ticks() - ticks) / os.sysconf("SC_CLK_TCK")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="sync,local-sgd")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    print("| strategy, workers | spawn: wall, CPU | forkserver: wall, CPU | wall ratio |")
    print("|---|---:|---:|---:|")
    for strategy in a.strategies.split(","):
        for workers in (int(w) for w in a.workers.split(",")):
            times: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
            for _ in range(a.repeats):
                for method in METHODS:
                    times[method].append(run(method, strategy, workers))
            med = {m: (statistics.median(t[0] for t in times[m]),
                       statistics.median(t[1] for t in times[m])) for m in METHODS}
            (sw, sc), (fw, fc) = med["spawn"], med["forkserver"]
            print(f"| {strategy}, {workers} | {sw:.2f} s, {sc:.1f} s | {fw:.2f} s, {fc:.1f} s "
                  f"| {sw / fw:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
