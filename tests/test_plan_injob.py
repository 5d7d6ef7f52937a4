"""``shoal train --strategy auto`` under torchrun (two real ranks on loopback): the probe,
the plan's trials and the winner all run on the job's own processes."""

from __future__ import annotations

import json
import sys

from conftest import run

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "-m", "shoal", "train", "--strategy", "auto", "--model", "mlp", "--dataset",
            "digits", "--target-accuracy", "0.9", "--progress", "none"]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_auto_under_torchrun_plans_on_the_jobs_ranks_and_trains_the_winner_there(tmp_path):
    """A run whose tenth holds a trial (a launch that cost nothing: ``--plan-probe-since``
    in the future) stops after sync's probe, plans with trials that are fresh trainers on
    the two ranks torchrun started (no planning session starts), and the winner trains on
    from the probe's checkpoint on the same ranks to the run's end."""
    out = tmp_path / "auto"
    res = run([*TORCHRUN, "--epochs", "10", "--trial-epochs", "0.2", "--plan-probe-since", "4e9",
               "--plan-candidates", "sync,local-sgd", "--out", str(out)], timeout=280)
    assert res.returncode == 0, res.stderr
    assert "planning for a tenth" in res.stderr and "planned on the job's 2 ranks" in res.stderr
    assert not res.stray
    plan = json.loads((out / "plan" / "plan.json").read_text())
    labels = [t["label"] for t in plan["trials"]]
    assert any(t["speed_only"] and t["strategy"] == "sync" for t in plan["trials"])  # the probe
    assert any(t["strategy"] == "local-sgd" and t["curve"] for t in plan["trials"]), labels
    assert all(t["workers"] == 2 for t in plan["trials"])  # only the job's own layout
    assert not (out / "plan" / "trials" / "sessions").exists()  # no planning session started
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["in_job"] and not summary["plan"]["skipped"]
    assert summary["completed"] and summary["steps"] == 10 * 45
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["init_from"] == str(out / "checkpoint.pt")
    assert [r["epoch"] for r in _records(out) if r["event"] == "epoch"] == list(range(1, 11))


def test_a_run_under_torchrun_that_cannot_pay_trains_sync_in_one_line(tmp_path):
    """A trial as long as the run (``--trial-epochs`` = ``--epochs``) never fits a tenth of
    it: sync goes on from the probe, and one line says so."""
    out = tmp_path / "auto"
    res = run([*TORCHRUN, "--epochs", "1", "--trial-epochs", "1", "--plan-probe-since", "4e9",
               "--out", str(out)], timeout=200)
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if "planning skipped" in line]
    assert len(said) == 1 and not res.stray
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["skipped"] and summary["plan"]["in_job"] and summary["completed"]
    assert json.loads((out / "config.json").read_text())["strategy"] == "sync"
