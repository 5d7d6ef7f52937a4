"""One failing rank brings the whole job down within seconds, with one line saying why."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import REPO, marked_processes, one_error_line, run, shoal, shoal_env

JOB = ["train", "--dataset", "digits", "--workers", "3", "--epochs", "2", "--timeout", "120",
       "--progress", "none"]


@pytest.mark.parametrize("model, expected", [
    ("tests.fixtures_models:raises_on_rank1", "rank 1: RuntimeError: injected failure"),
    ("tests.fixtures_models:killed_on_rank1", "rank 1: worker process killed by signal 9"),
])
def test_failing_rank_stops_the_job(tmp_path, model, expected):
    marker = uuid.uuid4().hex
    start = time.monotonic()
    res = shoal(*JOB, "--model", model, "--out", str(tmp_path), env=shoal_env(marker), timeout=60)
    elapsed = time.monotonic() - start
    assert res.returncode == 1
    assert expected in one_error_line(res.stderr)
    assert elapsed < 40, f"job took {elapsed:.0f}s to notice the failure (timeout is 120s)"
    assert res.stray == [], "worker processes outlived the job"


def test_failure_under_torchrun_stops_every_rank(tmp_path):
    marker = uuid.uuid4().hex
    start = time.monotonic()
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "-m", "shoal", *[a for a in JOB if a not in ("--workers", "3")],
               "--model", "tests.fixtures_models:raises_on_rank1", "--out", str(tmp_path)],
              env=shoal_env(marker), timeout=90)
    assert res.returncode != 0
    assert "rank 1" in res.stderr and "injected failure" in res.stderr
    assert time.monotonic() - start < 60
    assert res.stray == []


def test_debug_shows_the_workers_traceback(tmp_path):
    res = shoal(*JOB, "--model", "tests.fixtures_models:raises_on_rank1", "--out", str(tmp_path),
                "--debug", timeout=60)
    assert res.returncode == 1
    assert "traceback on rank 1" in res.stderr and "fixtures_models.py" in res.stderr


def test_workers_die_with_a_killed_launcher(tmp_path):
    """kill -9 of `shoal train` itself (not its process group) leaves no worker behind."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "shoal", *JOB, "--epochs", "500", "--out",
                             str(tmp_path)], env=shoal_env(marker), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(marked_processes(marker)) >= 4  # launcher + 3 workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marked_processes(marker) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
