"""Resume works from every step: the first, mid-epoch, an epoch's last, a finished run's last
(extended with more epochs), and where SIGTERM stopped the run, for every strategy, and ends
where an uninterrupted run does: the saved model and every rank's own replica.

All runs of one strategy share one pair of real Gloo worker processes (``shoal.launch``):
each :class:`Trainer` is a whole run (its own ``--out``), so the cases cost training steps,
not process starts. SIGTERM reaches one rank (it signals itself during a chosen step), and
the ranks agree on where to stop. The asynchronous strategies' SIGTERM and resume are in
``test_async_training.py`` (their servers are processes of their own).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

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


def _all_cases(root: str) -> dict[str, dict[str, Any]]:
    """Every strategy's resume cases on this rank (one process pair for all of them)."""
    from shoal.core.stop import stop_on_sigterm

    stop_on_sigterm()  # as shoal train's workers take SIGTERM: stop after an agreed step
    # A vote at every meeting (not one per spacing of time): SIGTERM during step 11 stops
    # every rank after step 12, an epoch's last, whatever the machine's pace.
    os.environ["SHOAL_STOP_VOTE_S"] = "0"
    return {s: _cases(s, f"{root}/{s}") for s in STRATEGIES}


def _sigterm_during(trainer: Any, step: int, rank: int) -> None:
    """Rank ``rank`` of ``trainer``'s run signals SIGTERM to itself during its step ``step``
    (1 first), as Slurm's notice would arrive there."""
    train_step = trainer.train_step

    def signalled(batches: Any) -> Any:
        if trainer.rank == rank and trainer.state.step + 1 == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(batches)

    trainer.train_step = signalled


def _cases(strategy: str, root: str) -> dict[str, Any]:
    """Every resume case of ``strategy`` on this rank: ``diffs``, max |param diff| from the
    uninterrupted run, of the model that is evaluated and saved (the center for EASGD, the
    global model for DiLoCo) and of this rank's own replica (which the checkpoint keeps per
    rank); the final ``period``; where SIGTERM ``stopped`` the run, as each record says it."""
    from shoal.core.stop import STOP
    from shoal.train.trainer import Trainer

    comm = shoal.init()
    name, options = STRATEGIES[strategy]
    base = TrainConfig(model="mlp", dataset="digits", strategy=name, strategy_options=options,
                       epochs=3, batch_size=64, schedule="constant", progress="none",
                       log_every=1).validate()

    out: dict[str, Any] = {"diffs": {}, "stopped": {}}

    def run(name: str, sigterm: int | None = None, **changes: object) -> dict[str, torch.Tensor]:
        cfg = dataclasses.replace(base, out=f"{root}/{name}", **changes)
        trainer = Trainer(cfg, comm)
        if sigterm is not None:
            _sigterm_during(trainer, sigterm, rank=1)
        summary = trainer.run()
        if sigterm is not None:
            out["stopped"] = _where_stopped(trainer.state.step, summary, Path(cfg.out))
            STOP.clear()  # this process goes on with other runs
        out["period"] = getattr(trainer.strategy, "period", 1)
        models = {"": trainer.strategy.eval_module, "replica ": trainer.model}
        return {f"{which}{k}": v.detach().clone()
                for which, model in models.items() for k, v in model.state_dict().items()}

    def compare(case: str, params: dict[str, torch.Tensor]) -> None:
        for replica, label in ((False, case), (True, f"{case}, replica")):
            out["diffs"][label] = max((params[k] - reference[k]).abs().max().item()
                                      for k in reference if k.startswith("replica ") == replica)

    reference = run("reference")
    for stop in (1, 7, STEPS_PER_EPOCH):
        run(f"stop{stop}", stop_at_step=stop)
        compare(f"stop at {stop}", run(f"stop{stop}", resume=""))
    run("extend", epochs=2)
    compare("extend a finished run", run("extend", resume=""))
    # SIGTERM during step 11: sync stops after step 12 (the vote taken at step 11 is read at
    # step 12), the last of epoch 1, before that epoch's record; the others at a meeting.
    run("sigterm", sigterm=STEPS_PER_EPOCH - 1)
    compare("after SIGTERM", run("sigterm", resume=""))
    return out


def _where_stopped(step: int, summary: dict[str, Any] | None, out: Path) -> dict[str, Any]:
    """Where a stopped run is, as rank 0's summary, the checkpoint and the epoch records
    (the last one's epoch, 0 for none) say it; ``step``: this rank's trainer's."""
    if summary is None:
        return {"trainer step": step}
    progress = torch.load(out / "checkpoint.pt", weights_only=True)["progress"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return {"trainer step": step, "stopped by": summary["stopped_by"],
            "summary": (summary["epochs"], summary["steps"]),
            "checkpoint": (progress["epoch"], progress["step"]),
            "records": max((r["epoch"] for r in records if r["event"] == "epoch"), default=0)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, list[dict[str, dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("resume")
    return root, shoal.launch(_all_cases, str(root), workers=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_from_any_step_matches_uninterrupted(results, strategy):
    root, ranks = results
    run_dir = root / strategy
    for rank, cases in enumerate(ranks):
        diffs = cases[strategy]["diffs"]
        assert diffs and all(d < 1e-6 for d in diffs.values()), (rank, diffs)
        if strategy == "local-sgd-tau-auto":
            period = cases[strategy]["period"]
            assert 1 <= period < 8, period  # the loss fell: AdaComm shortened the period
    for case in ("stop1", f"stop{STEPS_PER_EPOCH}", "extend", "sigterm"):
        records = [json.loads(line) for line in (run_dir / case / "metrics.jsonl").open()]
        steps = [r["step"] for r in records if r["event"] == "step"]
        assert steps == list(range(1, 3 * STEPS_PER_EPOCH + 1)), f"{case}: steps lost or doubled"
        epochs = [r["epoch"] for r in records if r["event"] == "epoch"]
        assert epochs == [1, 2, 3], f"{case}: epoch records {epochs}"
        assert json.loads((run_dir / case / "summary.json").read_text())["completed"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigterm_stops_every_rank_where_summary_checkpoint_and_records_say(results, strategy):
    _, ranks = results
    stopped = [cases[strategy]["stopped"] for cases in ranks]
    steps = {s["trainer step"] for s in stopped}
    assert len(steps) == 1, f"the ranks stopped after different steps: {stopped}"
    step = steps.pop()
    first = stopped[0]
    assert first["stopped by"] == "SIGTERM"
    epochs = step // STEPS_PER_EPOCH if step % STEPS_PER_EPOCH else step // STEPS_PER_EPOCH - 1
    # An epoch's last step stops before its record: that epoch is recorded after --resume.
    assert first["summary"] == first["checkpoint"] == (epochs, step), first
    assert first["records"] == epochs, first
    assert STEPS_PER_EPOCH - 1 < step < 2 * STEPS_PER_EPOCH + 1, step
