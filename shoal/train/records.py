"""Machine-readable run records: ``metrics.jsonl`` (one JSON object a line), summaries, the
Chrome trace, and (optionally) the same records as TensorBoard scalars."""

from __future__ import annotations

import json
import math
import os
import queue
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.core.files import atomic_write
from shoal.core.trust import open_own
from shoal.errors import ShoalError
from shoal.train.membership.messages import CheckpointPart, EpochEnd, decode_epoch, encode

if TYPE_CHECKING:
    from shoal.train.state import RunState


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def require_tensorboard() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or a one-line error naming the package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ShoalError("--tensorboard needs the 'tensorboard' package "
                         "(pip install tensorboard, or shoal[tensorboard])") from None
    return SummaryWriter


class TensorBoardLog:
    """Writes step and epoch records as TensorBoard scalars (x axis: the training step)."""

    #: record key -> scalar tag, for each kind of record
    TAGS = {
        "step": {"loss": "train/loss", "accuracy": "train/accuracy", "lr": "train/lr",
                 "samples_per_s": "perf/samples_per_s", "comm_fraction": "perf/comm_fraction"},
        "epoch": {"train_loss": "epoch/train_loss", "train_accuracy": "epoch/train_accuracy",
                  "test_loss": "test/loss", "test_accuracy": "test/accuracy"},
    }

    def __init__(self, logdir: Path, purge_step: int | None = None) -> None:
        self.writer = require_tensorboard()(log_dir=str(logdir), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        tags = self.TAGS.get(record.get("event", ""), {})
        step = record["step"]
        for key, tag in tags.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        if record.get("event") == "step":
            for cat, seconds in (record.get("time_s") or {}).items():
                self.writer.add_scalar(f"time_s/{cat}", seconds, step)

    def close(self) -> None:
        self.writer.close()


def _step(line: str) -> float | None:
    """The step of a ``metrics.jsonl`` line (0 for a record without one); ``None`` for a
    line that is no record (a blank one, or one torn when its writer was killed)."""
    try:
        record = json.loads(line) if line.strip() else None
        return float(record.get("step", 0)) if isinstance(record, dict) else None
    except (ValueError, TypeError):
        return None


class MetricsLog:
    """Appends records to ``metrics.jsonl``; each line is flushed as it is written."""

    def __init__(self, path: Path, keep_until_step: int | None = None,
                 tensorboard: TensorBoardLog | None = None, history: Path | None = None) -> None:
        """``keep_until_step``: resuming at that step; the records after it are dropped
        (they are about to be redone). ``history``: the resumed run's own log when it lives
        in another directory; its records up to the step start this one."""
        self.path = path
        self.tensorboard = tensorboard
        path.parent.mkdir(parents=True, exist_ok=True)
        source = history if history is not None and history.is_file() else path
        if keep_until_step is None:
            atomic_write(path, lambda f: None)  # a new, empty log (replacing, not truncating)
        elif source.exists():
            kept = [line for line in source.read_text().splitlines()
                    if _step(line) is not None and _step(line) <= keep_until_step]
            atomic_write(path, lambda f: f.write("".join(k + "\n" for k in kept).encode()))
        # Appended to, never through a link someone planted in --out.
        self._file = os.fdopen(open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_clean(record)) + "\n")
        self._file.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically."""
    text = json.dumps(_clean(data), indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def write_trace(path: Path, trace: dict[str, Any]) -> None:
    """Write a Chrome trace (see :func:`shoal.core.timeline.chrome_trace`) compactly, atomically."""
    text = json.dumps(trace, separators=(",", ":"))
    atomic_write(path, lambda f: f.write(text.encode()))


def pending_reports(epochs: dict[int, dict[int, EpochEnd]], saved: dict[int, CheckpointPart],
                    elastic: bool) -> tuple[dict[int, dict[int, EpochEnd]], int]:
    """What an asynchronous checkpoint keeps of the epoch reports not recorded yet
    (``epochs``: by epoch, by worker), given the states ``saved`` in it (by worker): each
    worker's reports of the epochs its state had ended (a resumed worker does the later
    work again, and reports again an epoch its state had not ended, though it saved that
    state at the epoch's last step: more of it may be dealt to it at the resume); and
    the samples of those it drops that count now: under ``--elastic`` a worker with no state
    in the file (lost, or a joiner) is not resumed and its work is not done again."""
    kept = {e: {w: r for w, r in got.items()
                if w in saved and r.epoch <= int(saved[w].own["progress"]["epoch"])}
            for e, got in epochs.items()}
    gone = sum(int(r.sums[2]) for got in epochs.values() for w, r in got.items()
               if w not in saved) if elastic else 0
    return {e: got for e, got in kept.items() if got}, gone


def coordinator_part(st: RunState, pending: dict[int, dict[int, EpochEnd]], samples: int,
                     dealt: dict[str, Any]) -> dict[str, Any]:
    """Server 0's part of an asynchronous checkpoint (read back by :func:`records_position`):
    where its records are (``st``, the ``samples`` counted), the epoch reports ``pending``
    as they travel, and under ``--elastic`` what was ``dealt``."""
    return {"epoch": st.epoch, "step": st.step, "samples": samples,
            "train_time_s": st.train_time_s, "wall_time_s": st.elapsed_s(), "lr": st.lr,
            "pending": {e: {w: encode(r) for w, r in got.items()} for e, got in pending.items()},
            **({"elastic": dealt} if dealt else {})}


def records_position(saved: dict[str, Any], steps_per_epoch: int
                     ) -> tuple[dict[str, Any], dict[int, dict[int, EpochEnd]]]:
    """Where the records of a checkpoint's :func:`coordinator_part` ``saved`` go on: their
    position, and the epoch reports not recorded yet (by epoch, by worker).

    Raises:
        BadReport: a pending report that is not an epoch's.
    """
    epoch = int(saved["epoch"])
    # The last record's step (an elastic worker's epoch may take more steps: dealt work).
    progress = {"epoch": epoch, "epoch_step": 0,
                "step": saved.get("step", epoch * steps_per_epoch), "samples": saved["samples"],
                "train_time_s": saved["train_time_s"], "wall_time_s": saved["wall_time_s"],
                "lr": saved["lr"]}
    return progress, {int(e): {int(w): decode_epoch(r) for w, r in reports.items()}
                      for e, reports in saved["pending"].items()}


def queued(reports: queue.Queue, wait: float) -> list[Any]:
    """Everything queued in ``reports`` now, waiting up to ``wait`` seconds for the first."""
    found = []
    try:
        found.append(reports.get(timeout=wait))
        while True:
            found.append(reports.get_nowait())
    except queue.Empty:
        return found
