"""A run that stops (asked to, or killed) and resumes ends exactly where an uninterrupted one does."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, checkpoint_params, max_param_diff, run, shoal_env, train

CONFIG = ["--model", "lenet5", "--dataset", "digits", "--epochs", "4", "--workers", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    summary = train(out, *CONFIG)
    return summary, checkpoint_params(out / "checkpoint.pt")


def test_stop_and_resume_matches_uninterrupted(tmp_path, reference):
    first = train(tmp_path, *CONFIG, "--stop-at-step", "70")  # mid-way through epoch 2
    assert first["steps"] == 70 and not first["completed"]
    second = train(tmp_path, *CONFIG, "--resume")
    assert second["completed"] and second["steps"] == reference[0]["steps"]
    assert max_param_diff(checkpoint_params(tmp_path / "checkpoint.pt"), reference[1]) < 1e-6
    assert second["test_accuracy"] == pytest.approx(reference[0]["test_accuracy"], abs=1e-9)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()
             if json.loads(line)["event"] == "step"]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "no step logged twice"


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path, reference):
    args = [sys.executable, "-m", "shoal", "train", "--out", str(tmp_path), "--progress", "none",
            *CONFIG, "--checkpoint-every", "5", "--log-every", "1"]
    proc = subprocess.Popen(args, env=shoal_env(), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["progress"]["step"]
    if saved >= reference[0]["steps"]:
        pytest.fail("the run finished before it could be killed; the test proves nothing")
    assert saved % 5 == 0 and saved >= 20
    resumed = train(tmp_path, *CONFIG, "--resume")
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
