"""A run that stops learning says so: a non-finite loss stops it at once (the last good
checkpoint kept), a collapse to chance stops it with its line and a non-zero exit, for the
synchronous trainer and an asynchronous run's coordinator alike (real processes, Gloo)."""

import json
import math
import subprocess

import pytest
import torch

from shoal.cli import main
from shoal.train.health import COLLAPSE_EPOCHS, Health

from conftest import one_error_line

LN10 = math.log(10)
DIGITS = ["--dataset", "digits", "--workers", "2", "--progress", "plain"]


@pytest.fixture
def train(capfd, monkeypatch):
    """``shoal train ARGS`` in this process (``shoal.cli.main``, the command's code; its
    workers forked from this process's server, which has torch already, so no interpreter
    and import of torch per run), with ``env`` set for it and its workers: its exit status
    and what it printed."""
    def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        capfd.readouterr()
        code = main(["train", *args])
        out, err = capfd.readouterr()
        for key in env:
            monkeypatch.delenv(key)
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def feed(health: Health, epochs: list[tuple[float, float, float]]) -> list[str | None]:
    return [health.epoch(i + 1, *e) for i, e in enumerate(epochs)]


def test_collapse_needs_better_epochs_then_several_at_chance():
    chance = (LN10, 0.1, 0.1)
    health = Health(10)
    lines = feed(health, [(1.2, 0.6, 0.8), chance, chance])
    assert lines == [None, None, None] and not health.collapsed and health.verdict() is None
    line = health.epoch(4, LN10 + 0.01, 0.11, float("nan"))  # untested epochs count too
    assert line is not None and "collapsed: since epoch 2" in line and "ln 10" in line
    assert health.stop and health.verdict()["kind"] == "collapsed"
    assert health.verdict()["epochs_at_chance"] == COLLAPSE_EPOCHS
    assert health.epoch(5, *chance) is None  # said once
    assert not Health(10, allow_collapse=True).stop


def test_a_slow_start_is_no_collapse_and_a_recovery_resets():
    health = Health(10)
    # At chance from the start (a deep net's first epochs): never a collapse, never a stop;
    # it learned nothing only if the run ends there.
    assert feed(health, [(LN10, 0.1, 0.1)] * 4) == [None] * 4 and not health.stop
    assert health.verdict()["kind"] == "learned nothing"
    health.epoch(5, 1.0, 0.7, 0.75)
    assert health.verdict() is None
    feed(health, [(LN10, 0.1, 0.1)] * 2 + [(1.0, 0.7, 0.75)] + [(LN10, 0.1, 0.1)] * 2)
    assert not health.collapsed  # two, a recovery, two: never three in a row
    # A loss near ln C with a good accuracy is not chance (calibration, not collapse).
    assert feed(Health(10), [(1.0, 0.7, 0.7)] + [(LN10, 0.6, 0.6)] * 4) == [None] * 5


def test_a_run_that_fell_back_from_its_best_says_so_at_the_end():
    # diloco at its old default, seed 2, 120 epochs: 88% at epoch 7, then about 19% for good
    # (loss 2.05, not chance): no collapse, but more than half of what it learned is lost.
    health = Health(10)
    fell = [(0.45, 0.89, 0.881)] + [(2.05, 0.18, 0.19)] * COLLAPSE_EPOCHS
    assert feed(health, fell) == [None] * (1 + COLLAPSE_EPOCHS) and not health.stop
    verdict = health.verdict()
    assert verdict["kind"] == "fell back" and verdict["best_test_accuracy"] == 0.881
    assert verdict["best_epoch"] == 1 and verdict["since_epoch"] == 2
    assert "fell back: test accuracy 19.0% at epoch 4 against 88.1% at epoch 1" in health.line()
    # Untested epochs leave the count as it is; one tested epoch back above half resets it.
    health.epoch(5, 2.05, 0.18, float("nan"))
    assert health.verdict()["kind"] == "fell back"
    health.epoch(6, 0.6, 0.8, 0.6)
    assert health.verdict() is None
    # Overfitting's small loss from the best is no fall, nor is a run that never learned much.
    overfit = Health(10)
    feed(overfit, [(0.1, 0.99, 0.97)] + [(0.01, 1.0, 0.90)] * 5)
    assert overfit.verdict() is None
    never = Health(10)
    feed(never, [(2.0, 0.19, 0.19)] + [(2.1, 0.12, 0.12)] * 5)
    assert never.verdict() is None


def test_collapsing_run_stops_with_its_line_and_exit_status(tmp_path, train):
    """A synchronous run that learns in epoch 1, then sits at chance from the first step of
    epoch 2 (45 steps an epoch), its tests too (the fixture's outputs turn to zeros there: a
    collapse at a known step on every CPU, where a real blow-up's path, its lr warming up to
    0.5, depended on the CPU's arithmetic: on one machine it recovered and "fell back"):
    stopped after 3 epochs at chance (epoch 4), exit 4, not `done:`; with --allow-collapse
    it trains every epoch and exits 0, the summary saying so all the same."""
    args = [*DIGITS, "--model", "tests.fixtures_models:collapse_everywhere_from",
            "--epochs", "6"]
    env = {"SHOAL_TEST_COLLAPSE_AT": "46"}
    res = train("--out", str(tmp_path / "stop"), *args, env=env)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "done:" not in res.stdout and "Traceback" not in res.stderr
    said = [ln for ln in res.stdout.splitlines() if "training collapsed: since epoch" in ln]
    assert len(said) == 2 and said[0].startswith("shoal: training collapsed"), res.stdout
    assert "since epoch 2" in said[0] and said[1].startswith("collapsed: test accuracy"), said
    summary = json.loads((tmp_path / "stop" / "summary.json").read_text())
    assert summary["collapsed"]["kind"] == "collapsed" and not summary["completed"]
    assert summary["epochs"] == 1 + COLLAPSE_EPOCHS and summary["test_accuracy"] < 0.15
    go_on = train("--out", str(tmp_path / "on"), *args, "--allow-collapse", env=env)
    assert go_on.returncode == 0, go_on.stdout + go_on.stderr
    summary = json.loads((tmp_path / "on" / "summary.json").read_text())
    assert summary["completed"] and summary["epochs"] == 6 and summary["collapsed"]
    assert "done:" not in go_on.stdout and "going on (--allow-collapse)" in go_on.stdout


@pytest.mark.parametrize("strategy", ["sync", "local-sgd", "async-sgd", "groups"])
def test_nan_stops_at_once_and_keeps_the_last_good_checkpoint(tmp_path, train, strategy):
    """The outputs turn NaN at step 60 (epoch 2 of 45 steps): the run stops at that step with
    one line (step, what to try, the checkpoint kept), exit 2; the checkpoint is epoch 1's,
    finite, never overwritten by the NaN state. (An asynchronous run's coordinator writes
    epoch 1's checkpoint once both workers sent their part, which the failure may overtake:
    there, whatever checkpoint exists is an earlier, finite one.)"""
    res = _turns_nan(train, tmp_path, strategy, {"SHOAL_TEST_NAN_AT": "60"})
    assert res.returncode == 2, res.stdout + res.stderr
    line = one_error_line(res.stderr)
    assert "training loss became nan at step 60 (epoch 2)" in line, line
    assert "--lr" in line and "done:" not in res.stdout, line
    path = tmp_path / "run" / "checkpoint.pt"
    if strategy in ("async-sgd", "groups"):  # a coordinator writes the checkpoints
        assert "keeps the last good state" in line or "no checkpoint holds it" in line, line
        if not path.exists():
            return
    else:
        assert "keeps the last good state" in line, line
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert saved["progress"]["step"] == 45
    assert all(torch.isfinite(t).all() for t in saved["eval_model"].values())


@pytest.mark.parametrize("strategy, more", [
    ("async-sgd", []), ("hogwild", []),
    # Two compute groups of two: a group's members agree on the step they stop after.
    ("groups", ["--workers", "4", "--groups", "2"])])
def test_a_collapsed_asynchronous_run_stops_its_workers(tmp_path, train, strategy, more):
    """Every worker's training sits at chance from its step 60 on (epoch 2 of 45 steps; 3 of
    23 on 4 workers): three epochs later each worker judges its own epochs collapsed (the
    coordinator, which may lag, judges the run's and tells them too) and stops, as a
    synchronous run's ranks do, instead of training all 12 epochs: exit 4, its line, no
    `done:`. Only the last epoch is tested (the
    fixture leaves the center as it was, so a tested epoch would not be at chance). A
    group's members vote on their stop at every meeting (``SHOAL_STOP_VOTE_S=0``): spaced
    50 ms apart, as by default, the votes of a model this small came a whole epoch later on
    one fresh clone's run (epoch 7 recorded), at a pace no test can fix."""
    res = train("--out", str(tmp_path / "run"), *DIGITS, "--strategy", strategy,
                "--model", "tests.fixtures_models:collapse_from", "--epochs", "12",
                "--eval-every", "12", *more,
                env={"SHOAL_TEST_COLLAPSE_AT": "60", "SHOAL_STOP_VOTE_S": "0"})
    assert res.returncode == 4, res.stdout + res.stderr
    assert "done:" not in res.stdout and "Traceback" not in res.stderr
    said = [ln for ln in res.stdout.splitlines() if "training collapsed: since epoch" in ln]
    assert said and said[-1].startswith("collapsed after"), res.stdout
    assert "nan" not in said[-1], said[-1]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["collapsed"]["kind"] == "collapsed" and not summary["completed"]
    assert summary["epochs"] <= 6, summary["epochs"]  # stopped, not trained to epoch 12


def test_workers_that_collapsed_where_the_center_tests_well_say_so(tmp_path, train):
    """The fixture's workers sit at chance while the center they leave unchanged tests well
    every epoch: the coordinator sees no collapse, the workers do and stop; the run says it
    stopped for that and exits 4, never as asked or `done:`."""
    res = train("--out", str(tmp_path / "run"), *DIGITS, "--strategy", "async-sgd",
                "--model", "tests.fixtures_models:collapse_from", "--epochs", "12",
                env={"SHOAL_TEST_COLLAPSE_AT": "60"})
    assert res.returncode == 4, res.stdout + res.stderr
    assert "stopped by collapse at step" in res.stdout and "done:" not in res.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by"] == "collapse" and summary["epochs"] < 12


@pytest.mark.parametrize("strategy", ["async-sgd", "hogwild"])
def test_an_asynchronous_workers_nan_is_named_at_its_own_step(tmp_path, train, strategy):
    """Worker 0 alone turns NaN, at its 60th step: the run names it at that step, and its NaN
    never reached the center (the other worker never computed on non-finite parameters, so
    it cannot stop first at a step of its own, as it did when the check came after the
    push)."""
    seen = tmp_path / "seen"
    seen.mkdir()
    res = _turns_nan(train, tmp_path, strategy, {
        "SHOAL_TEST_NAN_AT": "60", "SHOAL_TEST_NAN_RANK": "1", "SHOAL_TEST_NAN_SEEN": str(seen)})
    assert res.returncode == 2, res.stdout + res.stderr
    line = one_error_line(res.stderr)
    assert "worker 0 (rank 1): training loss became nan at step 60 (epoch 2)" in line, line
    found = {p.name: p.read_text() for p in sorted(seen.iterdir())}
    assert not found, f"{found}\n{res.stderr[-3000:]}"


def _turns_nan(train, tmp_path, strategy: str, env: dict[str, str]):
    """``shoal train`` of ``tests.fixtures_models:nan_from`` (digits, 3 epochs) with the
    fixture's settings ``env`` (at which step, on which rank its loss turns NaN)."""
    return train("--out", str(tmp_path / "run"), *DIGITS, "--strategy", strategy,
                 "--model", "tests.fixtures_models:nan_from", "--epochs", "3", env=env)
