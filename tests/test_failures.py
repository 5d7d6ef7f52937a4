"""One failing rank brings the whole job down within seconds, with one line saying why."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from shoal.cli import main

from conftest import REPO, marked_processes, one_error_line, popen, run, shoal_env, wait_gone

JOB = ["train", "--dataset", "digits", "--workers", "3", "--epochs", "2", "--timeout", "120",
       "--progress", "none"]


def shoal_here(capfd, monkeypatch, marker: str, *args: str) -> tuple[int, str, list[int]]:
    """``shoal ARGS`` run in this process (the command's own code path, minus an interpreter
    start-up), its workers carrying ``marker``: the exit status, everything written to
    stderr (by this process and by the workers, at the descriptor) and the marked processes
    still alive 5 s after it returned."""
    capfd.readouterr()
    with monkeypatch.context() as env:
        env.setenv("SHOAL_TEST_MARKER", marker)  # the workers inherit it
        code = main(list(args))
    err = capfd.readouterr().err
    return code, err, wait_gone(marker, 5.0)


@pytest.mark.parametrize("model, expected", [
    ("tests.fixtures_models:raises_on_rank1", "rank 1: RuntimeError: injected failure"),
    ("tests.fixtures_models:killed_on_rank1", "rank 1: worker process killed by signal 9"),
])
def test_failing_rank_stops_the_job(tmp_path, capfd, monkeypatch, model, expected):
    marker = uuid.uuid4().hex
    start = time.monotonic()
    code, err, stray = shoal_here(capfd, monkeypatch, marker, *JOB, "--model", model,
                                  "--out", str(tmp_path))
    elapsed = time.monotonic() - start
    assert code == 1
    assert expected in one_error_line(err)
    assert elapsed < 40, f"job took {elapsed:.0f}s to notice the failure (timeout is 120s)"
    assert stray == [], "worker processes outlived the job"


def test_a_mesh_that_did_not_form_at_the_start_is_started_once_more(tmp_path, capfd,
                                                                     monkeypatch):
    """Gloo's mesh failing to form as the job starts (its transient; CI met it) starts the
    job once more, without --max-restarts and not counted as a restart; the same failure
    again is the job's error."""
    monkeypatch.setenv("SHOAL_TEST_ONCE_FILE", str(tmp_path / "once"))
    job = [*JOB, "--workers", "2", "--model", "tests.fixtures_models:mesh_fails_once"]
    code, err, stray = shoal_here(capfd, monkeypatch, uuid.uuid4().hex, *job, "--out",
                                  str(tmp_path / "run"))
    assert code == 0, err
    assert "Gloo's connections did not form as the job started: starting it once more" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] and [r["mesh"] for r in summary["restarts"]] == [True]
    assert stray == []
    # Twice in a row (the file removed before each start): the second is the job's error.
    (tmp_path / "once").unlink()
    monkeypatch.setattr("shoal.train.job._last_logged_step", lambda out: (tmp_path / "once").unlink(
        missing_ok=True) or 0)
    code, err, _ = shoal_here(capfd, monkeypatch, uuid.uuid4().hex, *job, "--out",
                              str(tmp_path / "again"))
    assert code == 1 and "connectFullMesh failed" in one_error_line(err)


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


def test_debug_shows_the_workers_traceback(tmp_path, capfd, monkeypatch):
    code, err, _ = shoal_here(capfd, monkeypatch, uuid.uuid4().hex, *JOB, "--model",
                              "tests.fixtures_models:raises_on_rank1", "--out", str(tmp_path),
                              "--debug")
    assert code == 1
    assert "traceback on rank 1" in err and "fixtures_models.py" in err


def test_workers_die_with_a_killed_launcher(tmp_path):
    """kill -9 of `shoal train` itself (not its process group) leaves no worker behind."""
    marker = uuid.uuid4().hex
    proc = popen([sys.executable, "-m", "shoal", *JOB, "--epochs", "500", "--out",
                  str(tmp_path)], shoal_env(marker), cwd=REPO,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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
