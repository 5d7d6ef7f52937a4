"""--init-from (a run starts from another's evaluation model, whatever its strategy, and with
--init-progress goes on from its position) and --replan-every (shoal train --strategy auto
re-plans from its checkpoint within a tenth of the period)."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.cli import main
from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.errors import ShoalError
from shoal.train.optim import lr_factor
from shoal.train.trainer import Trainer

from conftest import max_param_diff, one_error_line


def config(out, **changes) -> TrainConfig:
    settings = dict(model="mlp", dataset="digits", epochs=2, batch_size=64, progress="none",
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
    Trainer(config(out, strategy="easgd", strategy_options={"tau": 2}, stop_at_step=30),
            comm).run()
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    center, worker = saved["eval_model"], saved["ranks"][0]["model"]
    assert max_param_diff(center, worker) > 1e-4  # the center is not the worker's model
    assert saved["progress"]["epoch"] == 1 and saved["progress"]["epoch_step"] > 0  # mid-epoch

    cfg = config(out, strategy="sync", lr=0.01, init_from=str(out / "checkpoint.pt"),
                 init_progress=True)
    trainer = Trainer(cfg, comm)
    assert max_param_diff(dict(trainer.model.state_dict()), center) == 0.0
    assert trainer.state.step == 30 and trainer.state.epoch == 1
    spe = trainer.plan.steps_per_epoch
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.01 * lr_factor(30, 2 * spe, 0, "cosine", [], 0.1))  # this run's rate, at step 30
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
             "global batch of 64"),
            (["--init-progress"], "needs --init-from"),
            (["--init-from", ckpt, "--resume"], "contradict"),
            (["--init-from", str(tmp_path / "none.pt")], "no checkpoint at"),
            (["--replan-every", "10m"], "--replan-every re-plans a --strategy auto run")):
        code = main(["train", "--model", "mlp", "--batch-size", "64", "--epochs", "2",
                     "--out", str(tmp_path / "new"), *args])
        assert code == 2, args
        assert message in one_error_line(capsys.readouterr().err), args
    with pytest.raises(ShoalError, match="nothing left to train"):
        from shoal.train.trainer import preflight

        preflight(config(tmp_path / "new", epochs=1, stop_at_step=2, init_from=ckpt,
                         init_progress=True), 1)
    assert not (tmp_path / "new").exists()
