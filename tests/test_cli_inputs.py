"""Bad values of the planning, ``shoal run``, asynchronous and ``--out`` flags, and the
messages about them: one ``shoal: error:`` line naming the flag and the problem, exit 2,
whatever the subcommand; a failing planning trial is one trial's failure, not the planner's;
a worker killed by a signal is not told to show a traceback it does not have; a refused
checkpoint is shoal's own line. The real command (``python -m shoal``) where the line is
what a user reads; in this process (``shoal.cli.main``) for the many values of one check.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from shoal.cli import main

from conftest import one_error_line, shoal, train_here

PLAN = ["plan", "--model", "mlp", "--epochs", "1", "--target-accuracy", "0.9"]


def line_of(*args: str, code: int = 2, timeout: float = 120) -> str:
    """``python -m shoal ARGS``: it must exit with ``code`` and print one error line."""
    res = shoal(*args, timeout=timeout)
    assert res.returncode == code, res.stderr
    return one_error_line(res.stderr)


def line_here(*args: str, code: int = 2) -> str:
    """``shoal ARGS`` in this process: it must exit with ``code`` and print one error line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        returned = main(list(args))
    assert returned == code, err.getvalue()
    return one_error_line(err.getvalue())


@pytest.mark.parametrize("args, line", [
    # once a two-line OverflowError, exit 1 (the budget became a wait no clock can hold)
    ([*PLAN, "--plan-budget", "1e99"], "--plan-budget must be at most a week (168h), got '1e99'"),
    # once argparse's "expected one argument": -5m looked like an option
    ([*PLAN, "--plan-budget", "-5m"],
     "--plan-budget must be a positive duration like 90s, 5m or 1h, got '-5m'"),
    # once accepted: a plan of sync alone
    ([*PLAN, "--plan-candidates", ","], "--plan-candidates must name at least one strategy, "
                                        "got none"),
    # once "shoal: error: shoal train: argument --max-staleness ..."
    (["train", "--strategy", "groups", "--max-staleness", "x"],
     "argument --max-staleness: invalid int value: 'x' (see shoal train --help)"),
    # once "shoal: error: shoal: unrecognized arguments", pointing at the wrong help
    ([*PLAN, "--bogus"], "unrecognized arguments: --bogus (see shoal plan --help)"),
])
def test_bad_input_is_one_line_of_the_real_command(tmp_path, args, line):
    # The first in an interpreter of its own (the command as a user starts it, 2-3 s); the
    # others through the same main() in this process (its whole code path, but that start).
    real = args[-1] == "1e99"
    said = (line_of if real else line_here)(*args, "--out", str(tmp_path / "out"))
    assert said == f"shoal: error: {line}"
    assert not (tmp_path / "out").exists()


def test_shoal_run_errors_have_one_prefix(tmp_path):
    # once "shoal: error: shoal run: no such file: ..."
    missing = tmp_path / "missing.py"
    assert line_of("run", str(missing)) == f"shoal: error: no such file: {missing}"


@pytest.mark.parametrize("args, line", [
    (["--plan-budget", "99999999999h"], "--plan-budget must be at most a week (168h), got "
                                        "'99999999999h'"),
    (["--plan-budget=-5m"], "--plan-budget must be a positive duration like 90s, 5m or 1h, "
                            "got '-5m'"),
    (["--plan-budget", "0"], "--plan-budget must be a positive duration like 90s, 5m or 1h, "
                             "got '0'"),
    (["--plan-budget", "nan"], "--plan-budget must be a duration like 90s, 5m or 1h, got 'nan'"),
    (["--plan-budget", "-inf"], "--plan-budget must be a duration like 90s, 5m or 1h, "
                                "got '-inf'"),
    (["--plan-budget", "1e400"], "--plan-budget must be a duration like 90s, 5m or 1h, "
                                 "got '1e400'"),
    (["--plan-budget", " "], "--plan-budget must be a duration like 90s, 5m or 1h, got ' '"),
    (["--plan-budget", "5 min"], "--plan-budget must be a duration like 90s, 5m or 1h, "
                                 "got '5 min'"),
    (["--strategy", "auto", "--replan-every", "1e99"], "--replan-every must be at most a week "
                                                       "(168h), got '1e99'"),
    (["--strategy", "auto", "--replan-every", "-1h"], "--replan-every must be a positive "
                                                      "duration like 90s, 5m or 1h, got '-1h'"),
    (["--plan-candidates", " , ,"], "--plan-candidates must name at least one strategy, got none"),
    (["--trial-epochs", "-0.5"], "--trial-epochs must be a positive number, got -0.5"),
    (["--target-accuracy", "-inf"], "--target-accuracy must be in (0, 1], got -inf"),
])
def test_bad_planning_values(tmp_path, args, line):
    # Checked with the other settings, whatever the strategy: before any planning or training.
    out = tmp_path / "out"
    assert line_here("train", "--out", str(out), *args) == f"shoal: error: {line}"
    assert line_here("plan", "--out", str(out), *args) == f"shoal: error: {line}"
    assert not out.exists()


@pytest.mark.parametrize("args, line", [
    (["--plan-candidates", "sync,,magic"], "unknown strategy 'magic'"),
    (["--plan-candidates", "async-sgd"], "--plan-candidates: the planner does not tune async-sgd"),
    (["--trial-epochs", "2"], "--trial-epochs 2.0 is more than --epochs 1"),
])
def test_bad_plan_settings_of_a_plan(tmp_path, args, line):
    assert line_here(*PLAN, "--out", str(tmp_path), *args).startswith(f"shoal: error: {line}")


@pytest.mark.parametrize("args, line", [
    (["--strategy", "groups", "--groups", "-inf"], "argument --groups: invalid int value: '-inf'"),
    (["--strategy", "groups", "--servers", "-1"], "--servers must be at least 1, got -1"),
    (["--strategy", "async-easgd", "--order", "-1"], "argument --order: invalid choice: '-1'"),
    (["--strategy", "async-sgd", "--max-staleness", "-5"], "--max-staleness must be at least 0"),
    (["--strategy", "async-msgd", "--momentum", "auto:-1"], "--momentum must be a number in "
                                                             "[0, 1), auto or auto:T"),
    (["--strategy", "local-sgd", "--tau", "auto:-4"], "--tau must be"),
    (["--strategy", "local-sgd", "--tau", "-inf"], "--tau must be"),
    (["--threads-per-worker", "99999999999"], "--threads-per-worker must be at most "),
])
def test_bad_asynchronous_and_layout_values(tmp_path, args, line):
    assert line in line_here("train", "--model", "mlp", "--out", str(tmp_path / "out"), *args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, line", [
    (["--workers", "-5"], "--workers must be at least 1, got -5"),
    (["--workers", "-inf"], "argument --workers: invalid int value: '-inf' (see shoal run --help)"),
    (["--threads-per-worker", "99999999999"], f"--threads-per-worker must be at most "
                                              f"{os.cpu_count()} (this machine's logical CPUs; "
                                              "more only take turns), got 99999999999"),
    ([], "give a SCRIPT or -m MODULE to run (see shoal run --help)"),
])
def test_bad_run_values(args, line):
    assert line_here("run", *args, *(["script.py"] if args else [])) == f"shoal: error: {line}"


# -- --out -----------------------------------------------------------------------------------
def _commands(tmp_path: Path, out: str) -> dict[str, list[str]]:
    """Every command that takes --out, ready to run but for ``out``."""
    run = tmp_path / "a-run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text('{"event": "step", "step": 1, "loss": 1.0}\n')
    return {"train": ["train", "--model", "mlp", "--epochs", "1", "--out", out],
            "plan": [*PLAN, "--out", out],
            "bench": ["bench", "--models", "mlp", "--workers", "1", "--out", out],
            "report": ["report", str(run), "--out", out]}


def _unusable(tmp_path: Path) -> dict[str, str]:
    """--out values no command can use, and the line each gets."""
    afile = tmp_path / "afile"
    afile.write_text("a user's file\n")
    proc = ("cannot write there (No such file or directory)" if os.access("/proc", os.W_OK)
            else "no permission to write in /proc")
    return {str(afile): f"--out {afile} exists and is not a directory",
            str(afile / "sub"): f"--out {afile}/sub is under {afile}, which is not a directory",
            "/proc/x": f"--out /proc/x: {proc}"}


@pytest.mark.parametrize("command", ["train", "plan", "bench", "report"])
def test_unusable_out_is_one_line_for_every_command(tmp_path, command):
    # once a raw FileNotFoundError / FileExistsError / NotADirectoryError, exit 1
    for out, line in _unusable(tmp_path).items():
        assert line_here(*_commands(tmp_path, out)[command]) == f"shoal: error: {line}"
    assert (tmp_path / "afile").read_text() == "a user's file\n"


def test_unusable_out_of_the_real_command(tmp_path):
    out, line = next(iter(_unusable(tmp_path).items()))
    assert line_of(*PLAN, "--out", out) == f"shoal: error: {line}"


@pytest.fixture
def locked_dir(tmp_path):
    """A directory this process may not write in: mode 555, or immutable for root (who
    writes anywhere else)."""
    path = tmp_path / "locked"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("root, and no immutable directories here")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("command", ["train", "plan", "bench", "report"])
def test_out_without_write_permission(tmp_path, locked_dir, command):
    args = _commands(tmp_path, str(locked_dir / "run"))[command]
    assert line_here(*args) == \
        f"shoal: error: --out {locked_dir / 'run'}: no permission to write in {locked_dir}"
    assert not any(locked_dir.iterdir())


# -- results read back -----------------------------------------------------------------------
def test_a_trial_that_leaves_no_summary_fails_alone_and_planning_goes_on(tmp_path):
    """Trial jobs run for real; the first loses its summary.json (as a job killed after its
    workers ended would), the second tears its metrics.jsonl: each is one failed trial with
    its line, and the next trial measures as ever."""
    from shoal.config import TrainConfig
    from shoal.plan.planner import Planner, PlanOptions
    from shoal.plan.trials import HARDWARE, Candidate
    from shoal.sweep.runner import Launcher

    def tear(out: Path) -> None:
        with (out / "metrics.jsonl").open("a") as f:
            f.write('{"event": "ev')

    damage = [lambda out: (out / "summary.json").unlink(), tear, lambda out: None]

    class Losing(Launcher):
        def train(self, args, processes, workers, out, name):
            super().train(args, processes, workers, out, name)
            damage.pop(0)(out)

    cfg = TrainConfig(model="mlp", dataset="digits", epochs=10, batch_size=16, workers=2,
                      target_accuracy=0.9, progress="none", out=str(tmp_path)).validate()
    with Losing(None, 120) as launcher:
        planner = Planner(cfg, PlanOptions.of(cfg), launcher, tmp_path, 2, show=False)
        # one process (not the job's layout of two): a job of its own, through the launcher
        trials = [planner.trial(Candidate("sync", (), 1, 1), HARDWARE) for _ in range(3)]
    outs = sorted(p for p in (tmp_path / "trials").glob("0*-sync*") if p.is_dir())
    assert trials[0].error == f"no trial's summary at {outs[0] / 'summary.json'}"
    assert trials[1].error.startswith(f"the trial's records {outs[1] / 'metrics.jsonl'} has "
                                      "a malformed line ")
    assert not trials[0].ok and not trials[1].ok
    assert trials[2].ok and trials[2].epoch_s > 0 and trials[2].curve


def test_a_plan_where_no_trial_trains_ends_in_one_line(tmp_path):
    out = tmp_path / "plan"
    res = shoal(*PLAN, "--epochs", "2", "--lr", "1e12", "--plan-budget", "10s", "--workers",
                "1", "--out", str(out), timeout=180)
    assert res.returncode == 2, res.stderr
    assert one_error_line(res.stderr) == ("shoal: error: planning found no configuration that "
                                          f"trains: see {out / 'plan.md'}")
    assert "diverged" in (out / "plan.md").read_text()  # the table says what each trial did


def test_resume_after_a_torn_metrics_line(tmp_path):
    """A run killed while appending to metrics.jsonl leaves a torn last line; resuming drops
    it (once: a raw JSONDecodeError, exit 1)."""
    train_here(tmp_path, "--model", "mlp", "--epochs", "1", "--stop-at-step", "3",
               "--log-every", "1")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"event": "step", "st')
    train_here(tmp_path, "--model", "mlp", "--epochs", "1", "--stop-at-step", "5",
               "--log-every", "1", "--resume")
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3, 4, 5]


# -- messages --------------------------------------------------------------------------------
def test_a_worker_killed_by_a_signal_gets_no_traceback_hint(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    # once "... killed by signal 9 (run with --debug for the traceback)": there is none
    assert line_of("run", "--workers", "1", str(script), code=1) == \
        "shoal: error: rank 0: worker process killed by signal 9"


class _Payload:
    """What a malicious checkpoint holds: unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_malicious_checkpoint_is_refused_in_shoals_words(tmp_path):
    evil = tmp_path / "evil.pt"
    marker = tmp_path / "pwned"
    torch.save({"format": "shoal-checkpoint", "version": 1, "x": _Payload(marker)}, evil)
    expected = (f"shoal: error: {evil} is not a checkpoint shoal can load safely: it asks to "
                f"import {os.system.__module__}.system, and shoal loads only tensors and plain "
                "data")
    for flag in ("--resume", "--init-from"):
        res = shoal("train", "--model", "mlp", "--out", str(tmp_path / "run"), flag, str(evil))
        assert res.returncode == 2, res.stderr
        assert one_error_line(res.stderr) == expected
        assert "weights_only" not in res.stderr and "Warning" not in res.stderr
    assert not marker.exists()
