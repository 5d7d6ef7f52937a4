"""Machine-readable run records: ``metrics.jsonl`` (one JSON object a line) and summaries."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from shoal.train.checkpoint import atomic_write

#: Where a training step's time goes; they add up to the step's wall time ("other" is the
#: loop's own bookkeeping).
TIME_CATEGORIES = ("data", "compute", "comm", "wait", "optim", "other")


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsLog:
    """Appends records to ``metrics.jsonl``; each line is flushed as it is written."""

    def __init__(self, path: Path, keep_until_step: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if keep_until_step is None:
            path.write_text("")
        elif path.exists():
            # Resuming: drop what was logged after the checkpoint, it is about to be redone.
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= keep_until_step]
            atomic_write(path, lambda f: f.write("".join(k + "\n" for k in kept).encode()))
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_clean(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically."""
    text = json.dumps(_clean(data), indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def time_split(totals: dict[str, float]) -> dict[str, float]:
    """Seconds per time category, zeros included, rounded for logs."""
    return {k: round(totals.get(k, 0.0), 6) for k in TIME_CATEGORIES}


def comm_fraction(totals: dict[str, float]) -> float:
    step_time = sum(totals.get(k, 0.0) for k in TIME_CATEGORIES)
    return totals.get("comm", 0.0) / step_time if step_time > 0 else 0.0
