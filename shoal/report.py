"""``shoal report RUN_DIR...``: several runs on one figure, and their summaries as a table.

Reads each run's ``metrics.jsonl`` (step and epoch records) and ``summary.json``; writes
``report.png`` (loss and accuracy against wall time and against samples seen) and
``report.md`` (one row per run).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.core.files import make_output_dir
from shoal.errors import ShoalError

#: (header, summary key, format) of the report table's columns.
COLUMNS = (
    ("run", "label", "{}"), ("model", "model", "{}"), ("strategy", "strategy", "{}"),
    ("workers", "workers", "{}"), ("global batch", "global_batch", "{}"),
    ("epochs", "epochs", "{}"), ("steps", "steps", "{}"),
    ("test acc", "test_accuracy", "{:.2%}"), ("test loss", "test_loss", "{:.4f}"),
    ("train loss", "train_loss", "{:.4f}"), ("wall s", "wall_time_s", "{:.1f}"),
    ("samples/s", "samples_per_s", "{:,.0f}"), ("comm", "comm_fraction", "{:.0%}"),
    ("wait", "wait_fraction", "{:.0%}"), ("bytes/sample", "bytes_per_sample", "{:,.0f}"),
)


def load_run(path: Path, label: str | None = None) -> dict[str, Any]:
    """A run directory's records: step and epoch records (with ``samples`` seen), summary."""
    if not path.is_dir():
        raise ShoalError(f"{path} is not a run directory")
    metrics, summary_file = path / "metrics.jsonl", path / "summary.json"
    if not metrics.is_file():
        raise ShoalError(f"{path} holds no metrics.jsonl (not a shoal run directory?)")
    try:
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        config = json.loads((path / "config.json").read_text()) \
            if (path / "config.json").is_file() else {}
    except (OSError, ValueError) as exc:
        raise ShoalError(f"{path}: cannot read its records: {exc}") from None
    batch = summary.get("global_batch") or _global_batch(config)
    for r in records:
        r["samples"] = r.get("step", 0) * batch if batch else None
    summary = {**summary, "label": label or path.name}
    steps = [r for r in records if r.get("event") == "step" and r.get("loss") is not None]
    epochs = [r for r in records if r.get("event") == "epoch"]
    if not steps and not epochs:
        raise ShoalError(f"{path}: metrics.jsonl holds no records yet")
    return {"label": summary["label"], "path": path, "summary": summary, "steps": steps,
            "epochs": epochs}


def _global_batch(config: dict[str, Any]) -> int | None:
    if config.get("global_batch_size"):
        return int(config["global_batch_size"])
    if config.get("batch_size") and config.get("world_size"):
        return int(config["batch_size"]) * int(config["world_size"])
    return None


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    try:
        return fmt.format(value)
    except (TypeError, ValueError):
        return str(value)


def summary_table(runs: Sequence[dict[str, Any]]) -> str:
    """The runs' ``summary.json`` values as a markdown table."""
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for run in runs:
        s = run["summary"]
        lines.append("| " + " | ".join(_cell(s.get(k), f) for _, k, f in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def _labels(paths: Sequence[Path]) -> list[str]:
    """Short unique names: the directory names, with parents where those collide."""
    names = [p.name or str(p) for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


def report(paths: Sequence[Path], out: Path) -> dict[str, Path]:
    """Write ``report.png`` and ``report.md`` for the runs in ``paths`` into ``out``."""
    from shoal.plots import report_figure, require_matplotlib

    if not paths:
        raise ShoalError("give at least one run directory")
    require_matplotlib()
    runs = [load_run(p, label) for p, label in zip(paths, _labels(paths), strict=True)]
    make_output_dir(out)
    files = {"png": out / "report.png", "md": out / "report.md"}
    report_figure(runs, files["png"])
    files["md"].write_text("# shoal report\n\n" + summary_table(runs)
                           + "\n![loss and accuracy](report.png)\n")
    return files
