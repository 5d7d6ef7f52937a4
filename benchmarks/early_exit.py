"""How long a two-rank job takes to end when rank 1 ends early while rank 0 waits in a plain
``torch.distributed.all_reduce``: under ``shoal run --workers 2`` and under ``torchrun
--standalone --nproc-per-node 2``, the same script each time (issue 55, part 4).

Rank 1 returns (its script ends), raises, calls ``os._exit(3)``, or forks a child that keeps
its sockets open and returns; the first row, where it joins the all_reduce, is the time a
job takes to start and end normally, under the same load. Each script joins the job with
``shoal.init()`` (``shoal`` rows) or with ``dist.init_process_group("gloo")`` of its own
(``own group`` rows). Each run's whole time is taken (start-up included) up to ``--limit``
seconds, after which it is killed and shown as ``>LIMIT``; the table gives the median of
``--repeats`` runs and the exit statuses seen. Run (on a quiet machine):

    .venv/bin/python benchmarks/early_exit.py --repeats 3 --limit 60
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

SCRIPT = """\
import os, sys, time
import torch, torch.distributed as dist
{join}
if dist.get_rank() == 1:
    {end}
else:
    dist.all_reduce(torch.ones(3))
"""

JOINS = {"shoal": "import shoal; shoal.init(timeout=600)",
         "own group": "dist.init_process_group('gloo')"}
ENDS = {
    "joins it (reference)": "dist.all_reduce(torch.ones(3))",  # start-up and a normal end
    "returns": "pass",
    "raises": "raise ValueError('boom')",
    "os._exit(3)": "os._exit(3)",
    "forks, returns": "if os.fork() == 0:\n        time.sleep(900)\n        os._exit(0)",
}
LAUNCHERS = {
    "shoal run": [str(BIN / "python"), "-m", "shoal", "run", "--workers", "2"],
    "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"],
}


def time_one(command: list[str], limit: float) -> tuple[float, int | None]:
    """Seconds ``command`` ran and its exit status (``None``: killed at ``limit``)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        code: int | None = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.monotonic() - start
    with contextlib.suppress(ProcessLookupError):  # the session's leftovers too (a forked
        os.killpg(proc.pid, signal.SIGKILL)  # child that holds a rank's sockets)
    proc.wait()
    return elapsed, code


def row(script: Path, launcher: str, repeats: int, limit: float) -> str:
    """``median s (statuses)`` of ``script`` under ``launcher``."""
    runs = [time_one([*LAUNCHERS[launcher], str(script)], limit) for _ in range(repeats)]
    codes = sorted({"hung" if code is None else str(code) for _, code in runs})
    if all(code is None for _, code in runs):
        return f">{limit:g} s (killed)"
    return f"{statistics.median(t for t, _ in runs):.1f} s (exit {', '.join(codes)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a run is killed")
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    print("| rank 1 | joins with | shoal run --workers 2 | torchrun --nproc-per-node 2 |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for end_name, end in ENDS.items():
            for join_name, join in JOINS.items():
                script = Path(tmp) / f"job{len(list(Path(tmp).iterdir()))}.py"
                script.write_text(SCRIPT.format(join=join, end=end))
                cells = [row(script, launcher, args.repeats, args.limit) for launcher in LAUNCHERS]
                print(f"| {end_name} | {join_name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
