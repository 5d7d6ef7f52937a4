"""A worker that stops running (``kill -STOP``) is named within seconds, by its heartbeat; a
worker that is only slow is not. Real processes, Gloo on CPU; nothing is left running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import shoal
from shoal.core.env import free_port
from shoal.core.failures import EXIT_ABORTED

from conftest import (
    REPO,
    marked_processes,
    one_error_line,
    popen,
    shoal_env,
    started_by,
    wait_gone,
)

pytestmark = pytest.mark.timeout(120)


def workers_of(launcher: int, count: int, timeout: float = 60.0) -> list[int]:
    """The pids of the ``count`` worker processes ``launcher`` started, in rank order.

    shoal's launcher starts rank 0 first, then rank 1, ...: the processes it started, sorted
    by start time (then pid), are in rank order.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = started_by(launcher)
        if len(found) == count:
            return found
        time.sleep(0.05)
    pytest.fail(f"the launcher did not start {count} workers within {timeout:.0f} s")


def thread_names(pid: int) -> set[str]:
    """The names of ``pid``'s threads, as ``ps -L`` and ``top -H`` show them."""
    names = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            names.add((task / "comm").read_text().strip())
    return names


@contextlib.contextmanager
def session(args: list[str], marker: str, env: dict[str, str] | None = None):
    """``args`` in a new session; it and every process carrying ``marker`` are killed after."""
    proc = popen(args, env or shoal_env(marker), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True, cwd=REPO, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
        for pid in marked_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def test_a_stopped_worker_is_named_within_seconds(tmp_path):
    """kill -STOP of rank 1 mid-training: with --heartbeat-timeout 3 the job ends within
    seconds (not after --timeout, 300 s) and the error names rank 1, not the rank that
    noticed it."""
    marker = uuid.uuid4().hex
    args = [sys.executable, "-m", "shoal", "train", "--model", "lenet5", "--dataset", "digits",
            "--workers", "2", "--epochs", "1000", "--heartbeat-timeout", "3", "--progress",
            "none", "--out", str(tmp_path)]
    with session(args, marker) as proc:
        rank1 = workers_of(proc.pid, 2)[1]
        deadline = time.monotonic() + 60
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # training is under way
        names = thread_names(rank1)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the job was still waiting for rank 1 30 s after it stopped")
        elapsed = time.monotonic() - stopped
        assert proc.returncode == 1, err
        line = one_error_line(err)
        assert "rank 1: " in line and "stopped responding: no heartbeat for 3 s" in line, line
        assert elapsed < 15, f"the job took {elapsed:.1f} s to stop after rank 1 did"
        assert wait_gone(marker, 5.0) == [], "processes outlived the job"
        assert "shoal-hb-r1" in names  # rank 1's watchdog thread, named for ps -L and top -H


def slow_on_rank1(seconds: float) -> float:
    comm = shoal.init(heartbeat_timeout=2.0)
    if comm.rank == 1:  # meanwhile rank 0 waits in the all-reduce below
        time.sleep(seconds)
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # pure Python: holds the GIL but for its switches
            sum(range(1000))
    ones = torch.ones(1)
    comm.all_reduce(ones)
    return ones.item()


def test_a_slow_worker_is_not_taken_for_a_hung_one():
    """Rank 1 sleeps, then computes, each for longer than the heartbeat timeout, before a
    collective: its watchdog thread keeps beating, so the job finishes."""
    marker = uuid.uuid4().hex
    os.environ["SHOAL_TEST_MARKER"] = marker
    try:
        assert shoal.launch(slow_on_rank1, 2.5, workers=2) == [2.0, 2.0]
    finally:
        del os.environ["SHOAL_TEST_MARKER"]
        assert wait_gone(marker, 5.0) == [], "worker processes outlived shoal.launch"


RANK_LOOP = """
import time, shoal
comm = shoal.init(heartbeat_timeout=2.0)
print("joined", flush=True)
while True:
    comm.barrier()
    time.sleep(0.05)
"""


def test_a_stopped_store_host_is_reported_within_seconds():
    """Under Slurm rank 0 serves the job's store. kill -STOP of rank 0 leaves every store call
    of rank 1 waiting forever; rank 1's watchdog says so within seconds and exits."""
    marker = uuid.uuid4().hex
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(2):
            env = {**shoal_env(marker), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
                   "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
                   "SLURM_JOB_ID": "77", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen([sys.executable, "-c", RANK_LOOP], env=env, cwd=REPO,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "joined\n"
        os.kill(procs[0].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = procs[1].communicate(timeout=30)
        elapsed = time.monotonic() - stopped
        assert procs[1].returncode == EXIT_ABORTED, err
        assert (f"shoal: rank 1 stopping: lost contact with the job's store at 127.0.0.1:{port} "
                "(served by rank 0): no answer for 2 s") in err
        assert elapsed < 10, f"rank 1 took {elapsed:.1f} s to notice"
    finally:
        for p in procs:
            p.kill()
            p.communicate()
        assert wait_gone(marker, 5.0) == []
