"""A small job's whole time and CPU, its workers forked from a server that imported torch
once (shoal's default on Linux) against fresh interpreters (``SHOAL_START_METHOD=spawn``),
or against another revision of shoal (``--baseline DIR``: a checkout of it, whose ``shoal``
is run the same way, forked workers too).

Each repeat runs ``shoal train --dataset digits --model mlp --epochs 1`` once each way, in
turn, for every strategy and worker count asked for; it times the whole command (start-up
included: that is what is measured) and the whole machine's CPU over it (``/proc/stat``,
so the fork server's own import counts; run it on a quiet machine). Each line gives the
medians and the ratio of the baseline's wall time to this tree's. Run:

    .venv/bin/python benchmarks/bench_start.py --strategies sync,local-sgd --workers 2,4 --repeats 3
    git worktree add /tmp/before <rev> && .venv/bin/python benchmarks/bench_start.py \\
        --strategies sync,local-sgd,rejected,run --baseline /tmp/before

Strategy ``run`` is ``shoal run --workers N`` of a script that only calls ``shoal.init()``.
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


def _cpu_ticks() -> int:
    """The machine's busy CPU time so far (user, nice, system, irq, softirq), in ticks."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6))


def _command(strategy: str, workers: int, out: str) -> tuple[list[str], int]:
    """The ``shoal`` command line of ``strategy`` and its expected exit status."""
    if strategy == "run":  # shoal run of a script that only joins the job
        script = Path(out) / "rank.py"
        script.write_text("import shoal\nshoal.init()\n")
        return ["run", "--workers", str(workers), str(script)], 0
    rejected = strategy == "rejected"
    return ["train", "--dataset", "digits", "--model", "mlp", "--workers", str(workers),
            "--epochs", "1", "--strategy", "sync" if rejected else strategy,
            *(["--lr", "-1"] if rejected else []), "--progress", "none",
            "--out", str(Path(out) / "run")], 2 if rejected else 0


def run(method: str, strategy: str, workers: int, tree: Path = REPO) -> tuple[float, float]:
    """One command's wall time and the machine's CPU seconds over it, shoal taken from
    ``tree``; strategy ``rejected``: a ``sync`` command refused after its checks
    (``--lr -1``), whose CPU counts what its fork server spent until killed; ``run``:
    ``shoal run`` of a script that calls ``shoal.init()`` and ends."""
    env = {**os.environ, "SHOAL_START_METHOD": method, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as out:
        args, expected = _command(strategy, workers, out)
        ticks, began = _cpu_ticks(), time.monotonic()
        res = subprocess.run([sys.executable, "-m", "shoal", *args], cwd=tree, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if res.returncode != expected:
            raise SystemExit(f"shoal {args[0]} ({strategy}, {workers} workers, {tree}) "
                             f"exited {res.returncode}")
        wall = time.monotonic() - began
        cpu = (_cpu_ticks() - ticks) / os.sysconf("SC_CLK_TCK")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="sync,local-sgd")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of another revision, run instead of spawn")
    a = parser.parse_args()
    ways = {"spawn": lambda s, w: run("spawn", s, w)} if a.baseline is None else \
        {"baseline": lambda s, w: run("forkserver", s, w, a.baseline.resolve())}
    ways["this tree"] = lambda s, w: run("forkserver", s, w)
    first, second = ways
    print(f"| strategy, workers | {first}: wall, CPU | {second}: wall, CPU | wall ratio "
          "| CPU ratio |")
    print("|---|---:|---:|---:|---:|")
    for strategy in a.strategies.split(","):
        for workers in (int(w) for w in a.workers.split(",")):
            times: dict[str, list[tuple[float, float]]] = {m: [] for m in ways}
            for _ in range(a.repeats):
                for way, job in ways.items():
                    times[way].append(job(strategy, workers))
            med = {m: (statistics.median(t[0] for t in times[m]),
                       statistics.median(t[1] for t in times[m])) for m in ways}
            (bw, bc), (tw, tc) = med[first], med[second]
            print(f"| {strategy}, {workers} | {bw:.2f} s, {bc:.1f} s | {tw:.2f} s, {tc:.1f} s "
                  f"| {bw / tw:.2f}x | {bc / tc:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
