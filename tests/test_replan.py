"""--init-from (a run starts from another's evaluation model, whatever its strategy, and with
--init-progress goes on from its position) and --replan-every (shoal train --strategy auto
re-plans from its checkpoint within a tenth of the period)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import shoal.plan as planning
from shoal.cli import main
from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.errors import ShoalError
from shoal.plan.planner import Planner, PlanOptions
from shoal.plan.search import Plan
from shoal.plan.trials import STATISTICAL, Candidate, Trial
from shoal.schema import parse_duration
from shoal.train.optim import lr_factor
from shoal.train.trainer import Trainer

from conftest import max_param_diff, one_error_line


def config(out, **changes) -> TrainConfig:
    settings = dict(model="mlp", dataset="digits", epochs=2, batch_size=128, progress="none",
                    log_every=5, out=str(out))
    return TrainConfig(**{**settings, **changes}).validate()


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_init_from_starts_from_another_strategys_evaluation_model(tmp_path):
    """An EASGD run's checkpoint keeps its center as the evaluation model; a sync run with
    --init-from starts from that center (not the worker's model), at a fresh optimizer, and
    with --init-progress at the checkpoint's step, epoch and schedule position, its records
    going on in the same metrics.jsonl."""
    comm = Comm(Environment(), torch.device("cpu"))
    out = tmp_path / "run"
    Trainer(config(out, strategy="easgd", strategy_options={"tau": 2}, stop_at_step=16),
            comm).run()
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    center, worker = saved["eval_model"], saved["ranks"][0]["model"]
    assert max_param_diff(center, worker) > 1e-4  # the center is not the worker's model
    assert saved["progress"]["epoch"] == 1 and saved["progress"]["epoch_step"] > 0  # mid-epoch

    cfg = config(out, strategy="sync", lr=0.01, init_from=str(out / "checkpoint.pt"),
                 init_progress=True)
    trainer = Trainer(cfg, comm)
    assert max_param_diff(dict(trainer.model.state_dict()), center) == 0.0
    assert trainer.state.step == 16 and trainer.state.epoch == 1
    spe = trainer.plan.steps_per_epoch
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.01 * lr_factor(16, 2 * spe, 0, "cosine", [], 0.1))  # this run's rate, at step 16
    assert not trainer.optimizer.state  # fresh: no momentum buffers
    summary = trainer.run()
    assert summary["completed"] and summary["steps"] == 2 * spe and summary["epochs"] == 2
    steps = [r["step"] for r in records(out)]
    assert steps == sorted(steps) and steps[0] == 5 and steps[-1] == 2 * spe
    assert [r["epoch"] for r in records(out) if r["event"] == "epoch"] == [1, 2]
    # The epoch the run went on in counts all its samples (the checkpoint's sums carried).
    epoch2 = [r for r in records(out) if r["event"] == "epoch"][1]
    assert summary["samples"] == 2 * len(trainer.data.train) and epoch2["train_accuracy"] > 0.5

    # Without --init-progress: the same model, a new run from step 0 elsewhere.
    fresh = Trainer(config(tmp_path / "warm", init_from=str(out / "checkpoint.pt"),
                           strategy="local-sgd"), comm)
    assert fresh.state.step == 0
    assert max_param_diff(dict(fresh.model.state_dict()),
                          torch.load(out / "checkpoint.pt", weights_only=True)["eval_model"]) == 0


def test_init_from_errors_are_one_line(tmp_path, capsys):
    comm = Comm(Environment(), torch.device("cpu"))
    out = tmp_path / "run"
    Trainer(config(out, stop_at_step=3), comm).run()
    ckpt = str(out / "checkpoint.pt")
    for args, message in (
            (["--init-from", ckpt, "--model", "lenet5"], "made with --model 'mlp'"),
            (["--init-from", ckpt, "--init-progress", "--seed", "3"], "made with --seed 0"),
            (["--init-from", ckpt, "--init-progress", "--global-batch-size", "32"],
             "global batch of 128"),
            (["--init-progress"], "needs --init-from"),
            (["--init-from", ckpt, "--resume"], "contradict"),
            (["--init-from", str(tmp_path / "none.pt")], "no checkpoint at"),
            (["--replan-every", "10m"], "--replan-every re-plans a --strategy auto run"),
            (["--strategy", "auto", "--target-accuracy", "0.9", "--replan-every", "soon"],
             "--replan-every must be a duration")):
        code = main(["train", "--model", "mlp", "--batch-size", "128", "--epochs", "2",
                     "--out", str(tmp_path / "new"), *args])
        assert code == 2, args
        assert message in one_error_line(capsys.readouterr().err), args
    with pytest.raises(ShoalError, match="nothing left to train"):
        from shoal.train.trainer import preflight

        preflight(config(tmp_path / "new", epochs=1, stop_at_step=2, init_from=ckpt,
                         init_progress=True), 1)
    assert not (tmp_path / "new").exists()


class InProcess:
    """A launcher that runs each trial as ``shoal.cli.main`` in this process (one worker)."""

    def emulated(self, workers: int) -> bool:
        return False

    timeout = 120.0

    def train(self, args: list[str], processes: int, workers: int, out, name: str) -> None:
        assert main(["train", *args, "--workers", str(workers)]) == 0

    def job(self, program: list[str], processes: int, workers: int, out, name: str,
            secrets: dict[str, str]) -> None:
        from shoal.plan import worker

        assert program[:2] == ["-m", "shoal.plan.worker"]  # one worker: served right here
        with pytest.MonkeyPatch.context() as mp:
            for key, value in secrets.items():
                mp.setenv(key, value)
            assert worker.main([*program[2:], "--workers", str(workers)]) == 0


def test_a_replan_trial_starts_from_the_checkpoint(tmp_path):
    """A re-plan's trials go on from the run's checkpoint (mid-epoch here): each trains to
    the next epoch end, its curve counts epochs and seconds from the checkpoint, and the
    search starts from the run's accuracy there, over the epochs left."""
    comm = Comm(Environment(), torch.device("cpu"))
    out = tmp_path / "run"
    Trainer(config(out, epochs=3, stop_at_step=16), comm).run()
    tested = [r["test_accuracy"] for r in records(out) if r["event"] == "epoch"]
    cfg = config(out, strategy="auto", epochs=3, target_accuracy=0.99, trial_epochs=1,
                 init_from=str(out / "checkpoint.pt"), init_progress=True)
    incumbent = Trial(Candidate("sync", (), 1, None), epoch_s=1.0, cost_s=2.0)
    planner = Planner(cfg, PlanOptions.of(cfg), InProcess(), tmp_path / "plan-1", 1,
                      show=False, incumbent=incumbent)
    spe = planner.steps_per_epoch
    assert planner.start.step == 16 and planner.settings.chance == tested[-1]
    assert planner.settings.epochs == pytest.approx(3 - 16 / spe)
    assert planner.settings.trial_cost_s == 2.0  # the first trial is costed too
    trial = planner.trial(Candidate("local-sgd", (("tau", 2),), 1, None, momentum=0.5), STATISTICAL)
    planner.session.close()
    assert trial.ok, trial.error
    # An epoch of steps from step 16 (12 steps an epoch), tested at whole periods (tau 2:
    # every 2 steps of an epoch: steps 18, 20, 22, the epoch end 24, 26, 28).
    assert spe == 12 and trial.startup_s > 0
    assert [e for e, _, _ in trial.curve] == pytest.approx([(s - 16) / spe for s in range(18, 29, 2)])
    assert all(0 < seconds < 60 for _, _, seconds in trial.curve)
    trial_dir = tmp_path / "plan-1" / "trials" / "01-local-sgd_tau=2_1xauto_mu=0.5"
    tested = [r for r in records(trial_dir) if r["event"] in ("eval", "epoch") and r["step"] > 16]
    training = [r["elapsed_s"] - planner.start.wall_s - r["eval_s"] for r in tested]
    # seconds an epoch: training time (tests left out) over the trial's epochs, plus one test
    assert trial.epoch_s == pytest.approx((training[-1] - training[0]) / (1 - 2 / spe)
                                          + tested[-1]["eval_s"] / len(tested))
    trial_config = json.loads((trial_dir / "config.json").read_text())
    assert trial_config["init_from"] == str(out / "checkpoint.pt")
    assert trial_config["replan_every"] is None and trial_config["stop_at_step"] == 28
    assert trial_config["eval_every_steps"] == 2


def test_replanning_trains_to_the_end_replanning_within_a_tenth(tmp_path, monkeypatch):
    """--replan-every 10s with a winner of 10 s an epoch: a segment of an epoch, then a
    re-plan from the checkpoint with at most 1 s of budget, measuring the incumbent first;
    the new winner goes on from there, until the run's epochs are done, in one
    metrics.jsonl; summary.json lists the segments and the re-plans."""
    out = tmp_path / "auto"
    cfg = config(out, strategy="auto", epochs=3, target_accuracy=0.999, replan_every="10s")
    calls: list[tuple] = []
    winners = [("sync", {}), ("local-sgd", {"tau": 2}), ("sync", {})]

    def fake_plan(c: TrainConfig, where=None, launcher=None, incumbent=None) -> Plan:
        strategy, options = winners[len(calls)]
        calls.append((c, where, incumbent))
        winner = dataclasses.replace(c, strategy=strategy, strategy_options=options, workers=1,
                                     global_batch_size=128, replan_every=None, overwrite=True)
        trial = Trial(Candidate(strategy, tuple(options.items()), 1, None), curve=[(1, .5, 10.)],
                      epoch_s=10.0, cost_s=0.5)
        return Plan([trial], [], winner, f"plan {len(calls)}", [], 0.25)

    monkeypatch.setattr(planning, "plan", fake_plan)
    planning.plan_and_train(cfg)
    assert [where for _, where, _ in calls] == [out / "plan", out / "plan-1", out / "plan-2"]
    assert calls[0][2] is None
    for i, (c, _, incumbent) in enumerate(calls[1:]):
        assert parse_duration(c.plan_budget, "--plan-budget") <= 0.1 * 10  # Omnivore's overhead rule
        assert c.init_from == str(out / "checkpoint.pt") and c.init_progress
        assert incumbent.candidate.strategy == winners[i][0]  # the one training until then
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["epochs"] == 3 and summary["strategy"] == "sync"
    spe = summary["steps"] // 3
    assert [(s["winner"].split()[0], s["from_step"], s["to_step"]) for s in summary["segments"]] \
        == [("sync", 0, spe + 1), ("local-sgd:tau=2", spe + 1, 2 * spe + 1),
            ("sync", 2 * spe + 1, 3 * spe)]  # each epoch's test is the segment's that trained it
    assert [(r["at_step"], r["dir"], r["budget_s"]) for r in summary["replans"]] \
        == [(spe + 1, "plan-1", 1.0), (2 * spe + 1, "plan-2", 1.0)]
    assert summary["replans"][0]["changed"] and summary["replanning_s"] >= 0
    assert summary["training_s"] > 0 and summary["plan"]["why"] == "plan 1"
    steps = [r["step"] for r in records(out)]
    assert steps == sorted(steps) and steps[-1] == 3 * spe
    epochs = [r for r in records(out) if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2, 3] and all(r["samples_per_s"] for r in epochs)
