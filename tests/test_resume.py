"""A run that stops (asked to, or killed) and resumes ends exactly where an uninterrupted one does."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shoal.config import TrainConfig
from shoal.errors import ShoalError

from conftest import (
    REPO,
    checkpoint_params,
    max_param_diff,
    popen,
    run,
    shoal_env,
    started_by,
    train_here,
    wait_gone,
)

CONFIG = ["--model", "lenet5", "--dataset", "digits", "--epochs", "3", "--workers", "2",
          "--batch-size", "32"]  # 23 steps an epoch


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    summary = train_here(out, *CONFIG)
    return summary, checkpoint_params(out / "checkpoint.pt")


def test_stop_and_resume_matches_uninterrupted(tmp_path, reference):
    first = train_here(tmp_path, *CONFIG, "--stop-at-step", "35")  # mid-way through epoch 2
    assert first["steps"] == 35 and not first["completed"]
    second = train_here(tmp_path, *CONFIG, "--resume")
    assert second["completed"] and second["steps"] == reference[0]["steps"]
    assert max_param_diff(checkpoint_params(tmp_path / "checkpoint.pt"), reference[1]) < 1e-6
    assert second["test_accuracy"] == pytest.approx(reference[0]["test_accuracy"], abs=1e-9)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()
             if json.loads(line)["event"] == "step"]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "no step logged twice"


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path, reference):
    args = [sys.executable, "-m", "shoal", "train", "--out", str(tmp_path), "--progress", "none",
            *CONFIG, "--checkpoint-every", "5", "--log-every", "1"]
    env = shoal_env()
    proc = popen(args, env, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count('"event": "step"') >= 23:
                break
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    # Every process of the job ends, not only the launcher waited for: one still exiting
    # (its fork server, tearing down torch's memory under load) holds --out's lock.
    assert not wait_gone(env["SHOAL_TEST_MARKER"], 30.0)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["progress"]["step"]
    if saved >= reference[0]["steps"]:
        pytest.fail("the run finished before it could be killed; the test proves nothing")
    assert saved % 5 == 0 and saved >= 20
    resumed = train_here(tmp_path, *CONFIG, "--resume")
    assert resumed["completed"]
    assert max_param_diff(checkpoint_params(tmp_path / "checkpoint.pt"), reference[1]) < 1e-6


def test_torchrun_runs_the_same_command(tmp_path, reference):
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "shoal", "train", "--out", str(tmp_path),
               "--progress", "none", *[a for a in CONFIG if a not in ("--workers", "2")]],
              timeout=180)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 2
    assert max_param_diff(checkpoint_params(tmp_path / "checkpoint.pt"), reference[1]) < 1e-6


def _start(tmp_path, *extra, env=None):
    """Start ``shoal train`` with CONFIG in the background; returns the Popen."""
    args = [sys.executable, "-m", "shoal", "train", "--out", str(tmp_path / "run"),
            "--progress", "none", *CONFIG, "--log-every", "1", *extra]
    return popen(args, env or shoal_env(), cwd=REPO, start_new_session=True,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(run_dir: Path, proc, step: int, timeout: float = 60) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count('"event": "step"') >= step:
            return
        time.sleep(0.01)
    pytest.fail(f"the run never reached step {step}")


def test_sigterm_to_the_launcher_checkpoints_and_says_how_to_resume(tmp_path, reference):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = shoal_env()
    env["TMPDIR"] = str(tmp)
    proc = _start(tmp_path, env=env)
    try:
        _wait_for_step(tmp_path / "run", proc, 20)
        proc.send_signal(signal.SIGTERM)  # the launcher only, as Slurm's notice reaches it
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and not summary["completed"]
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["progress"]["step"]
    assert saved == summary["steps"] >= 20
    assert f"stopped by SIGTERM at step {saved}" in err and "--resume" in err
    assert not list(tmp.glob("shoal-errors-*")), "the launcher left its error folder behind"
    resumed = train_here(tmp_path / "run", *CONFIG, "--resume")
    assert resumed["completed"]
    assert max_param_diff(checkpoint_params(tmp_path / "run" / "checkpoint.pt"),
                          reference[1]) < 1e-6


def test_max_restarts_recovers_a_killed_worker_without_losing_a_step(tmp_path, reference):
    proc = _start(tmp_path, "--checkpoint-every", "10", "--max-restarts", "2")
    try:
        _wait_for_step(tmp_path / "run", proc, 25)
        workers = started_by(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert "rank 1: worker process killed by signal 9; restarting from the checkpoint at step" \
        in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == reference[0]["steps"]
    (restart,) = summary["restarts"]
    assert restart["resumed_from_step"] % 10 == 0 and restart["resumed_from_step"] >= 20
    assert restart["failed_at_step"] >= restart["resumed_from_step"]
    assert summary["samples"] == reference[0]["samples"], "samples lost or counted twice"
    assert max_param_diff(checkpoint_params(tmp_path / "run" / "checkpoint.pt"),
                          reference[1]) < 1e-6
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").open()
             if json.loads(line)["event"] == "step"]
    assert steps == list(range(1, reference[0]["steps"] + 1)), "steps lost or logged twice"


NOTING = '''
import torch
from shoal.strategies import Strategy


class Noting(Strategy):
    """Keeps a note of every rank's own in checkpoints, and one for all ranks."""

    restored = None

    def checkpoint_shared(self):
        return {**super().checkpoint_shared(), "shared_note": torch.tensor(float(self.steps))}

    def checkpoint_own(self):
        return {**super().checkpoint_own(), "own_note": self.steps}

    def restore_checkpoint(self, shared, own):
        super().restore_checkpoint(shared, own)
        self.restored = (shared["shared_note"].item(), own["own_note"])


class Clashing(Strategy):
    def checkpoint_own(self):
        return {**super().checkpoint_own(), "rng": 0}
'''


def test_the_strategy_decides_what_a_checkpoint_keeps(tmp_path):
    """What a strategy puts in a checkpoint (once, and per rank) comes back on resume; a part
    that would overwrite the trainer's own is refused in one line."""
    from shoal.core.comm import Comm
    from shoal.core.env import Environment
    from shoal.train.trainer import Trainer

    (tmp_path / "noting.py").write_text(NOTING)
    comm = Comm(Environment(), torch.device("cpu"))

    def config(name: str, **changes) -> TrainConfig:
        return TrainConfig(model="mlp", dataset="digits", strategy=f"{tmp_path}/noting.py:{name}",
                           epochs=1, batch_size=64, progress="none", out=str(tmp_path / name),
                           **changes).validate()

    Trainer(config("Noting", stop_at_step=3), comm).run()
    saved = torch.load(tmp_path / "Noting" / "checkpoint.pt", weights_only=True)
    assert saved["shared_note"].item() == 3 and saved["ranks"][0]["own_note"] == 3
    assert Trainer(config("Noting", resume=""), comm).strategy.restored == (3.0, 3)
    with pytest.raises(ShoalError, match=r"Clashing: checkpoint_own\(\) returns 'rng'"):
        Trainer(config("Clashing", stop_at_step=1), comm).run()
