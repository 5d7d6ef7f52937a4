"""How shoal's processes start (``shoal/core/starting.py``): forked from a server that
imported torch once, each takes its launcher's environment and standard streams as they are
at its start, ends as an interpreter does (exit handlers run), and a SIGTERM sent to the
whole job checkpoints it instead of killing the server and every worker with it. Real
processes throughout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import shoal
from shoal.core.starting import ensure_server, start_method

from conftest import REPO, shoal_env, started_by, wait_gone

pytestmark = pytest.mark.timeout(180)


def _report(rank_file_dir: str) -> tuple[str | None, int]:
    """In each rank: say where this process's stdout goes, what the launcher set late, and
    leave a file behind from an exit handler (run only if the process ends as Python does)."""
    import atexit

    rank = int(os.environ["RANK"])
    print(f"rank {rank} says hello", flush=True)
    atexit.register(lambda: open(os.path.join(rank_file_dir, f"exit{rank}"), "w").close())
    return os.environ.get("SHOAL_TEST_LATE"), os.getppid()


def test_a_process_takes_its_launchers_environment_and_streams_as_they_are_now(tmp_path):
    """The server started (and forked a job) before the launcher set a variable and sent
    its stdout to a file: the next job's ranks see both, and their exit handlers run."""
    ensure_server()
    shoal.launch(_report, str(tmp_path), workers=2)  # an earlier job, from the same server
    saved = os.dup(1)
    log = tmp_path / "stdout.txt"
    os.environ["SHOAL_TEST_LATE"] = "set after the server started"
    try:
        with open(log, "w") as f:
            os.dup2(f.fileno(), 1)
            results = shoal.launch(_report, str(tmp_path), workers=2)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        del os.environ["SHOAL_TEST_LATE"]
    assert [late for late, _ in results] == ["set after the server started"] * 2
    text = log.read_text()
    assert "rank 0 says hello" in text and "rank 1 says hello" in text
    assert (tmp_path / "exit0").exists() and (tmp_path / "exit1").exists()
    if start_method() == "forkserver":  # forked from one server, not started by this process
        parents = {parent for _, parent in results}
        assert len(parents) == 1 and os.getpid() not in parents


def test_sigterm_to_the_whole_job_checkpoints_and_stops(tmp_path):
    """``kill -TERM`` of the job's process group (what Slurm's notice does: every process
    of the step gets it, the server that forks the workers too) stops the run at a step
    with its checkpoint, exit status 143, and nothing left running."""
    env = shoal_env()
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal", "train", "--model", "mlp", "--dataset", "digits",
         "--workers", "2", "--epochs", "1000", "--log-every", "1", "--progress", "none",
         "--out", str(out)], env=env, cwd=REPO, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().count('"event": "step"') >= 5:
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where each process is stuck, then fail
            for pid in started_by(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"the job did not stop within 60 s of SIGTERM:\n{err}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["steps"] >= 5
    assert (out / "checkpoint.pt").is_file()
    assert wait_gone(env["SHOAL_TEST_MARKER"], 5.0) == []


def test_spawn_when_asked(monkeypatch):
    monkeypatch.setenv("SHOAL_START_METHOD", "spawn")
    assert start_method() == "spawn"
    monkeypatch.delenv("SHOAL_START_METHOD")
    assert start_method() == ("forkserver" if sys.platform.startswith("linux") else "spawn")


def test_every_thread_that_asks_reads_a_processs_real_exit_status():
    """Two threads asking for a process's exit status at once (shoal.fork's watcher thread
    and the main thread's ``join``) both get it: the server sends it once, and before, the
    thread that lost the race read end-of-file, which multiprocessing reports as 255."""
    import threading

    from shoal.core.processes import start_process

    for _ in range(8):
        process = start_process(os._exit, (3,))
        seen: list[int | None] = []
        barrier = threading.Barrier(3)

        def ask(p=process, seen=seen, barrier=barrier):
            barrier.wait()
            while p.exitcode is None:
                pass
            seen.append(p.exitcode)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        barrier.wait()
        process.join(30)
        for t in threads:
            t.join(30)
        assert seen == [3, 3] and process.exitcode == 3
