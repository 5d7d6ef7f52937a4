"""Nothing lost, nobody let in: a run touches only its own files, holds its --out against a
second run, refuses to resume over another run, and listens on loopback only."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.cli import main

from conftest import REPO, is_loopback, shoal_env, sockets_of_a_running_job

TINY = ["--model", "mlp", "--dataset", "digits", "--batch-size", "64", "--epochs", "1",
        "--progress", "none"]


def _train(capsys, out: Path, *extra: str) -> tuple[int, str]:
    code = main(["train", "--out", str(out), *TINY, *extra])
    return code, capsys.readouterr().err


def test_a_users_temporary_files_in_out_are_left_alone(tmp_path, capsys):
    mine = [tmp_path / ".notes.tmp", tmp_path / ".draft.1234abcd.tmp",
            tmp_path / ".checkpoint.pt.abcdefgh.tmp"]  # the last: shoal's old temporary name
    for f in mine:
        f.write_text("user data")
    stale = tmp_path / ".shoal-tmp-checkpoint.pt.k2j4h5g6.tmp"  # a killed writer's leftover
    stale.write_bytes(b"half a checkpoint")
    code, err = _train(capsys, tmp_path)
    assert code == 0, err
    assert all(f.read_text() == "user data" for f in mine)
    assert not stale.exists()
    assert not (tmp_path / ".shoal.lock").exists(), "the lock is removed when the run ends"


def test_a_second_run_into_the_same_out_is_refused_naming_the_first(tmp_path, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from shoal.train.outdir import OutputLock; OutputLock(Path(sys.argv[1])).acquire(); "
         "print('locked', flush=True); time.sleep(60)", str(tmp_path)],
        env=shoal_env(), cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, err = _train(capsys, tmp_path)
        assert code == 2
        assert f"is in use by another shoal run (pid {holder.pid} on" in err
        assert not (tmp_path / "metrics.jsonl").exists()
        holder.kill()  # however the first run ends, the kernel frees the lock
        holder.wait(timeout=10)
        code, err = _train(capsys, tmp_path)
        assert code == 0, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)


@pytest.fixture
def stopped_run(tmp_path, capsys) -> Path:
    """A run stopped at step 5 (of 23), in ``tmp_path / "a"``."""
    out = tmp_path / "a"
    code, err = _train(capsys, out, "--stop-at-step", "5", "--log-every", "1")
    assert code == 0, err
    return out


def test_resume_into_an_out_holding_another_run_is_refused(tmp_path, capsys, stopped_run):
    other = tmp_path / "b"
    code, err = _train(capsys, other)
    assert code == 0, err
    before = {f.name: f.read_bytes() for f in other.iterdir()}
    code, err = _train(capsys, other, "--resume", str(stopped_run / "checkpoint.pt"))
    assert code == 2 and "already holds another run" in err, err
    assert {f.name: f.read_bytes() for f in other.iterdir()} == before


def test_resume_into_a_new_out_carries_the_metrics_over(tmp_path, capsys, stopped_run):
    new = tmp_path / "c"
    code, err = _train(capsys, new, "--resume", str(stopped_run / "checkpoint.pt"),
                       "--log-every", "1")
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (new / "metrics.jsonl").open()
             if json.loads(line)["event"] == "step"]
    assert steps == list(range(1, 24))


@pytest.mark.parametrize(("flags", "message"), [
    (["--schedule", "step"], "checkpoint was made with --schedule 'cosine', this run has "
                             "--schedule 'step'"),
    (["--warmup-epochs", "1"], "--warmup-epochs"),
    (["--stop-at-step", "3"], "--stop-at-step 3 is not after the checkpoint's step 5"),
])
def test_resume_refuses_what_would_not_continue_the_run(capsys, stopped_run, flags, message):
    code, err = _train(capsys, stopped_run, "--resume", *flags)
    assert code == 2 and message in err, err


def test_a_local_job_listens_on_loopback_only(tmp_path):
    job, sockets = sockets_of_a_running_job(
        tmp_path, "--model", "lenet5", "--dataset", "digits", "--workers", "2")
    assert len(job) >= 3 and sockets, (job, sockets)  # the launcher serves the store
    assert all(is_loopback(addr) for _, addr, _ in sockets), sockets


def test_resume_auto_starts_fresh_then_continues(tmp_path, capsys):
    code, err = _train(capsys, tmp_path, "--resume", "auto", "--stop-at-step", "4")
    assert code == 0, err  # nothing to resume: a fresh start
    code, err = _train(capsys, tmp_path, "--resume", "auto", "--log-every", "1")
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()
             if json.loads(line)["event"] == "step"]
    assert summary["completed"] and steps == list(range(5, 24))  # continued after step 4
