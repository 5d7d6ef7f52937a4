"""``--plan-budget auto`` (the default): ``shoal train --strategy auto`` times sync's first
steps in the run itself, then plans for a tenth of sync's predicted time or not at all, and
the run ends with sync's or the winner's records either way (real processes)."""

from __future__ import annotations

import json

import pytest

from shoal.cli import main
from shoal.plan.budget import auto_budget
from shoal.plan.search import TAUS, Candidate, Trial
from shoal.train.probe import FIRST_PERIOD, PLAN_SHARE

from conftest import one_error_line

RUN = ["--model", "mlp", "--dataset", "digits", "--target-accuracy", "0.9", "--progress", "none"]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_short_run_skips_planning_in_one_line_and_trains_sync(tmp_path, capfd):
    """A run whose tenth holds no planning session's start-up and trial is the sync run the
    probe started: one line says so, no plan is made, and the records are sync's, whole."""
    out = tmp_path / "auto"
    assert main(["train", "--strategy", "auto", *RUN, "--workers", "1", "--epochs", "2",
                 "--out", str(out)]) == 0
    said = [line for line in capfd.readouterr().err.splitlines() if "planning skipped" in line]
    assert len(said) == 1 and said[0].startswith("shoal: sync's first 20 steps predict")
    summary = json.loads((out / "summary.json").read_text())
    probe = json.loads((out / "probe.json").read_text())
    assert summary["plan"]["skipped"] and summary["plan"]["probe"] == probe and not probe["plans"]
    assert probe["budget_s"] == pytest.approx(PLAN_SHARE * probe["predicted_s"])
    assert probe["budget_s"] < probe["needed_s"] and probe["steps"] == 20
    assert summary["completed"] and summary["steps"] == 2 * 90  # 1437 rows, batch 16
    assert json.loads((out / "config.json").read_text())["strategy"] == "sync"
    assert [r["epoch"] for r in _records(out) if r["event"] == "epoch"] == [1, 2]
    assert not (out / "plan").exists()


def test_a_run_shorter_than_the_probe_trains_sync(tmp_path, capfd):
    out = tmp_path / "auto"
    assert main(["train", "--strategy", "auto", *RUN, "--workers", "1", "--epochs", "1",
                 "--batch-size", "256", "--out", str(out)]) == 0
    assert "shorter than sync's probe (20 steps): planning skipped" in capfd.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["skipped"] and summary["plan"]["probe"] is None
    assert summary["completed"] and not (out / "probe.json").exists()


def test_a_run_that_pays_for_planning_stops_plans_and_goes_on_from_the_probe(tmp_path, capfd):
    """A launch that cost nothing (``--plan-probe-since`` in the future: no start-up) on
    two workers: a tenth of the run holds the cheapest trial, so the probe stops the run at
    step 20 (checkpointed), the plan starts from there with sync's speed from the probe,
    and the winner trains on from the probe's checkpoint to the run's end."""
    out = tmp_path / "auto"
    assert main(["train", "--strategy", "auto", *RUN, "--workers", "2", "--epochs", "3",
                 "--plan-probe-since", "4e9", "--plan-candidates", "sync,local-sgd",
                 "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert "shoal: sync's first 20 steps predict" in err and "planning for a tenth" in err
    probe = json.loads((out / "probe.json").read_text())
    assert probe["plans"] and probe["startup_s"] == 0 and 0 < probe["comm_fraction"] < 1
    plan = json.loads((out / "plan" / "plan.json").read_text())
    assert plan["budget_s"] == pytest.approx(probe["budget_s"])
    seed = next(t for t in plan["trials"] if t["strategy"] == "sync" and t["speed_only"])
    assert seed["workers"] == 2 and seed["epoch_s"] == pytest.approx(probe["step_s"] * 45)
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["plan"]["skipped"] and summary["plan"]["probe"] == probe
    assert summary["completed"] and summary["steps"] == 3 * 45
    config = json.loads((out / "config.json").read_text())
    assert config["init_from"] == str(out / "checkpoint.pt") and config["init_progress"]
    records = _records(out)
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == [1, 2, 3]
    assert min(r["step"] for r in records if r["event"] == "step") <= 20  # the probe's own


def test_an_explicit_budget_plans_without_a_probe_and_probe_needs_sync(tmp_path, capsys):
    assert main(["train", "--strategy", "local-sgd", "--plan-probe", "20", "--out",
                 str(tmp_path / "r")]) == 2
    assert "--plan-probe times a sync run" in one_error_line(capsys.readouterr().err)
    assert main(["train", "--strategy", "sync", "--plan-probe", "3", "--out",
                 str(tmp_path / "r")]) == 2
    assert "--plan-probe" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


def test_shoal_plans_auto_budget_is_a_tenth_of_syncs_trial_prediction():
    """``shoal plan`` has no run to probe: its first trial (sync) sets the budget."""
    sync = Trial(Candidate("sync", (), 2), curve=[(1, 0.5, 2.0)], epoch_s=2.0, cost_s=5.0,
                 startup_s=3.0)
    budget, line = auto_budget(sync, 15)
    assert budget == pytest.approx(PLAN_SHARE * (3.0 + 15 * 2.0)) and "33 s" in line
    failed = Trial(Candidate("sync", (), 2), error="boom", cost_s=4.0)
    assert auto_budget(failed, 15)[0] == 4.0  # nothing to predict from: the plan stops
    assert TAUS[0] == FIRST_PERIOD  # the probe prices the walk's first step
