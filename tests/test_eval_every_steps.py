"""--eval-every-steps: tests inside epochs (the planner's short trials are tested this way),
recorded as `eval` records whose accuracy is the evaluation model's at that step."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.data import load_dataset
from shoal.models import build_model
from shoal.train.trainer import Trainer, data_options


def test_tests_inside_epochs_and_where_the_run_stops(tmp_path):
    """digits, 12 steps an epoch: tests at epoch steps 5 and 10 and at each epoch end, and
    at step 19 where --stop-at-step stops; the last one scores what the checkpoint's model
    scores on the test set, counted by hand."""
    out = tmp_path / "run"
    cfg = TrainConfig(model="mlp", dataset="digits", epochs=3, batch_size=128, progress="none",
                      eval_every_steps=5, stop_at_step=19, out=str(out)).validate()
    Trainer(cfg, Comm(Environment(), torch.device("cpu"))).run()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tested = [r for r in records if r["event"] in ("eval", "epoch")]
    assert [(r["event"], r["step"]) for r in tested] == [
        ("eval", 5), ("eval", 10), ("epoch", 12), ("eval", 17), ("eval", 19)]
    assert [r["epoch"] for r in tested] == pytest.approx([5 / 12, 10 / 12, 1, 1 + 5 / 12, 1 + 7 / 12])
    spent = [r["eval_s"] for r in tested]
    assert all(0 < a < b for a, b in zip(spent, spent[1:], strict=False))
    assert all(r["eval_s"] < r["elapsed_s"] for r in tested)

    data = load_dataset("digits", data_options(cfg))
    model = build_model("mlp", data.input_shape, data.num_classes).double()
    model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["eval_model"])
    x, y = data.test.get_batch(torch.arange(len(data.test)))
    x = x.double()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).double().mean().item()
    assert tested[-1]["test_accuracy"] == pytest.approx(accuracy, abs=1.5 / len(y))

