"""What a trial's run left behind, read back: where a plan's trials start (a re-plan's
checkpoint), a finished trial's test curve and its time per epoch. Every record is read
through :func:`~shoal.core.files.read_records` and a malformed one is one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.files import read_records
from shoal.errors import ShoalError
from shoal.train.checkpoint import load_checkpoint


@dataclass(frozen=True)
class Start:
    """Where a plan's trials start: step 0 of a new run, or (a re-plan) the checkpoint of
    ``--init-from --init-progress``: its step, wall time and the run's last test accuracy."""

    step: int = 0
    wall_s: float = 0.0
    accuracy: float = 0.0


def start_of(cfg: TrainConfig) -> Start:
    """The :class:`Start` of ``cfg``'s trials (the accuracy from the run's metrics.jsonl)."""
    if not (cfg.init_from and cfg.init_progress):
        return Start()
    path = Path(cfg.init_from)
    progress = load_checkpoint(path, mmap=True)["progress"]
    log = path.parent / "metrics.jsonl"
    records = read_records(log, "run's records") if log.is_file() else []
    try:
        tested = [r["test_accuracy"] for r in records if r.get("event") == "epoch"
                  and r["step"] <= progress["step"] and r.get("test_accuracy") is not None]
        return Start(int(progress["step"]), float(progress["wall_time_s"]),
                     float(tested[-1]) if tested else 0.0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ShoalError(f"{log} holds a malformed record ({type(exc).__name__}: {exc})") from None


def trial_curve(out: Path, start: Start, steps_per_epoch: int, eval_every: int = 1
           ) -> tuple[list[tuple[float, float, float]], float]:
    """A finished trial's (epochs, test accuracy, elapsed s) since ``start`` (its tests
    inside epochs and at their ends), and the seconds an epoch of the run takes: the
    training time between its first and last test (warm: the first includes starting up)
    over the epochs between them, plus a test's time every ``eval_every`` epochs (as the run
    will test; the trial's many tests are not counted)."""
    records = read_records(out / "metrics.jsonl", "trial's records")
    tested = [r for r in records if r["event"] in ("epoch", "eval") and r["step"] > start.step
              and r.get("test_accuracy") is not None and math.isfinite(r["test_accuracy"])]
    if not tested:
        raise ShoalError(f"trial in {out} recorded no test accuracy")
    curve = [(_whole((r["step"] - start.step) / steps_per_epoch), float(r["test_accuracy"]),
              float(r["elapsed_s"]) - start.wall_s) for r in tested]
    training = [float(r["elapsed_s"]) - start.wall_s - float(r.get("eval_s", 0.0)) for r in tested]
    (e0, t0), (e1, t1) = ((curve[0][0], training[0]) if len(curve) > 1 else (0.0, 0.0),
                          (curve[-1][0], training[-1]))
    one_test = float(tested[-1].get("eval_s", 0.0)) / len(tested)
    return curve, (t1 - t0) / (e1 - e0) + one_test / eval_every


def trial_speed(summary: dict[str, Any], out: Path, start: Start, steps_per_epoch: int) -> float:
    """A speed-only trial's seconds an epoch, from its ``summary`` (its run in ``out``): its
    wall time since ``start`` over its steps (the first step's warm-up included)."""
    steps = int(summary["steps"]) - start.step
    if steps <= 0:
        raise ShoalError(f"trial in {out} trained no step")
    return (float(summary["wall_time_s"]) - start.wall_s) / steps * steps_per_epoch


def _whole(epochs: float) -> float:
    """``epochs``, an ``int`` when whole (the epochs of a trial from a run's start)."""
    return int(epochs) if epochs.is_integer() else epochs
