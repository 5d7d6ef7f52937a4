"""How long a replacement takes to join a running ``--elastic`` job, and the CPU it spends on
the way: ``shoal join OUT`` of this tree against another revision's (``--baseline DIR``, a
checkout of it), in turn, each joining a job of its own tree.

Each repeat starts ``shoal train --workers 2 --max-workers 3 --elastic`` (digits' MLP,
epochs enough to outlast the join), waits until it trains, then starts ``shoal join OUT``
and times it to the launcher's line ``worker 2 joined at step ...`` (the joiner admitted,
the job's state handed to it); the job is then stopped by SIGTERM. The join's CPU is its
whole process tree's up to that line (its processes in a cgroup of their own; cgroup v1's
``cpuacct``, as root; otherwise not measured). The job's two workers keep both of this
machine's cores busy meanwhile, as a real job does: the joiner competes with them. Run:

    git worktree add /tmp/before <rev> && sudo .venv/bin/python benchmarks/bench_join.py \\
        --strategies local-sgd,sync --repeats 3 --baseline /tmp/before
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
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CGROUP = Path("/sys/fs/cgroup/cpuacct")
TIMEOUT = 120.0


class Cgroup:
    """A cpuacct cgroup of v1 for one command's processes (``None`` usage where there is
    none to make: not root, or no v1 hierarchy)."""

    def __init__(self) -> None:
        self.path: Path | None = CGROUP / f"shoal-bench-join-{os.getpid()}"
        try:
            self.path.mkdir()
        except OSError:
            self.path = None

    def enter(self) -> None:
        """Put the calling process (a child before its exec) in the cgroup."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> float | None:
        """CPU seconds of every process that was in the cgroup so far."""
        return None if self.path is None else \
            int((self.path / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        """Hand back what is left in it to the root group, then remove it."""
        if self.path is None:
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CGROUP / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _wait_for(what: str, check: Callable[[], object], deadline: float) -> None:
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def one_join(strategy: str, tree: Path) -> tuple[float, float | None]:
    """One join of ``tree``'s ``shoal join`` into a job of the same tree: the seconds from
    its start to its admission, and its CPU seconds until then."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "run", Path(tmp) / "job.log"
        with log.open("w") as sink:
            job = subprocess.Popen(
                [sys.executable, "-m", "shoal", "train", "--dataset", "digits", "--model", "mlp",
                 "--workers", "2", "--max-workers", "3", "--elastic", "--strategy", strategy,
                 "--epochs", "1000", "--progress", "none", "--out", str(out)],
                cwd=tree, env=env, stdout=sink, stderr=sink, start_new_session=True)
        group = Cgroup()
        join = None
        try:
            deadline = time.monotonic() + TIMEOUT
            metrics = out / "metrics.jsonl"
            _wait_for("the job to train", lambda: metrics.exists() and metrics.stat().st_size,
                      deadline)
            began = time.monotonic()
            join = subprocess.Popen([sys.executable, "-m", "shoal", "join", str(out)], cwd=tree,
                                    env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, preexec_fn=group.enter)
            _wait_for("the join", lambda: "joined at step" in log.read_text(), deadline)
            took, cpu = time.monotonic() - began, group.usage()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGTERM)
            for p in (job, join):
                if p is not None:
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
            group.remove()
    return took, cpu


def _cell(times: list[tuple[float, float | None]]) -> tuple[float, float | None, str]:
    wall = statistics.median(t[0] for t in times)
    cpus = [t[1] for t in times if t[1] is not None]
    cpu = statistics.median(cpus) if cpus else None
    return wall, cpu, f"{wall:.2f} s, " + ("-" if cpu is None else f"{cpu:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="local-sgd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, required=True,
                        help="a checkout of another revision, joined the same way")
    a = parser.parse_args()
    trees = {"baseline": a.baseline.resolve(), "this tree": REPO}
    print("| strategy | baseline: to admission, CPU | this tree: to admission, CPU "
          "| wall ratio | CPU ratio |")
    print("|---|---:|---:|---:|---:|")
    for strategy in a.strategies.split(","):
        times: dict[str, list[tuple[float, float | None]]] = {t: [] for t in trees}
        for _ in range(a.repeats):
            for name, tree in trees.items():
                times[name].append(one_join(strategy, tree))
        (bw, bc, bcell), (tw, tc, tcell) = _cell(times["baseline"]), _cell(times["this tree"])
        ratio = "-" if bc is None or tc is None else f"{bc / tc:.2f}x"
        print(f"| {strategy} | {bcell} | {tcell} | {bw / tw:.2f}x | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
