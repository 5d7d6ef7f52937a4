"""Resume works from every step: the first, mid-epoch, an epoch's last, a finished run's last
(extended with more epochs), for every strategy, and ends where an uninterrupted run does:
the saved model and every rank's own replica.

All runs of one strategy share one pair of real Gloo worker processes (``shoal.launch``):
each :class:`Trainer` is a whole run (its own ``--out``), so the cases cost training steps,
not process starts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import shoal
from shoal.config import TrainConfig

#: case -> (strategy, its options); "local-sgd-tau-auto": AdaComm's period, which changes
#: with the loss the workers share (so a resumed run must put back the rounds' state too).
STRATEGIES = {"sync": ("sync", {}), "local-sgd": ("local-sgd", {}), "easgd": ("easgd", {}),
              "eamsgd": ("eamsgd", {}), "diloco": ("diloco", {}),
              "local-sgd-tau-auto": ("local-sgd", {"tau": "auto:8"})}
STEPS_PER_EPOCH = 12  # digits: 1437 training samples, global batch 2 x 64


def _all_cases(root: str) -> dict[str, dict[str, float]]:
    """Every strategy's resume cases on this rank (one process pair for all of them)."""
    return {s: _cases(s, f"{root}/{s}") for s in STRATEGIES}


def _cases(strategy: str, root: str) -> dict[str, float]:
    """Every resume case of ``strategy`` on this rank: max |param diff| from the uninterrupted
    run, of the model that is evaluated and saved (the center for EASGD, the global model for
    DiLoCo) and of this rank's own replica (which the checkpoint keeps per rank)."""
    from shoal.train.trainer import Trainer

    comm = shoal.init()
    name, options = STRATEGIES[strategy]
    base = TrainConfig(model="mlp", dataset="digits", strategy=name, strategy_options=options,
                       epochs=3, batch_size=64, schedule="constant", progress="none",
                       log_every=1).validate()

    last_period = [0]

    def run(name: str, **changes: object) -> dict[str, torch.Tensor]:
        cfg = dataclasses.replace(base, out=f"{root}/{name}", **changes)
        trainer = Trainer(cfg, comm)
        trainer.run()
        last_period[:] = [getattr(trainer.strategy, "period", 1)]
        models = {"": trainer.strategy.eval_module, "replica ": trainer.model}
        return {f"{which}{k}": v.detach().clone()
                for which, model in models.items() for k, v in model.state_dict().items()}

    def diff(params: dict[str, torch.Tensor], replica: bool) -> float:
        return max((params[k] - reference[k]).abs().max().item()
                   for k in reference if k.startswith("replica ") == replica)

    reference = run("reference")
    diffs = {"final period": float(last_period[0])}
    for stop in (1, 7, STEPS_PER_EPOCH):
        run(f"stop{stop}", stop_at_step=stop)
        params = run(f"stop{stop}", resume="")
        diffs[f"stop at {stop}"] = diff(params, replica=False)
        diffs[f"stop at {stop}, replica"] = diff(params, replica=True)
    run("extend", epochs=2)
    params = run("extend", resume="")
    diffs["extend a finished run"] = diff(params, replica=False)
    diffs["extend a finished run, replica"] = diff(params, replica=True)
    return diffs


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, list[dict[str, dict[str, float]]]]:
    root = tmp_path_factory.mktemp("resume")
    return root, shoal.launch(_all_cases, str(root), workers=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_from_any_step_matches_uninterrupted(results, strategy):
    root, ranks = results
    run_dir = root / strategy
    for rank, all_diffs in enumerate(ranks):
        diffs = dict(all_diffs[strategy])
        period = diffs.pop("final period")
        assert diffs and all(d < 1e-6 for d in diffs.values()), (rank, diffs)
        if strategy == "local-sgd-tau-auto":
            assert 1 <= period < 8, period  # the loss fell: AdaComm shortened the period
    for case in ("stop1", f"stop{STEPS_PER_EPOCH}", "extend"):
        records = [json.loads(line) for line in (run_dir / case / "metrics.jsonl").open()]
        steps = [r["step"] for r in records if r["event"] == "step"]
        assert steps == list(range(1, 3 * STEPS_PER_EPOCH + 1)), f"{case}: steps lost or doubled"
        epochs = [r["epoch"] for r in records if r["event"] == "epoch"]
        assert epochs == [1, 2, 3], f"{case}: epoch records {epochs}"
        assert json.loads((run_dir / case / "summary.json").read_text())["completed"]
