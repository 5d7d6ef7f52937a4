"""The sweep's rows as files: ``bench.csv``, ``bench.md`` (markdown table) and ``bench.png``."""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.sweep.config import BenchConfig
from shoal.sweep.spec import REFERENCE

CSV_FIELDS = ("model", "strategy", "scaling", "workers", "threads", "threads_label",
              "global_batch", "repeats", "samples_per_s", "samples_per_s_min",
              "samples_per_s_max", "efficiency", "comm_fraction", "wait_fraction", "bytes_per_sample",
              "runs")


def _pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.0f}%"


def _bytes(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a markdown table (throughput median with the repeats' range)."""
    lines = ["| model | strategy | scaling | workers | threads/worker | global batch | "
             "samples/s (median) | range | efficiency | comm | wait | bytes/sample |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        eff = "" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['scaling']} | {r['workers']} | "
            f"{r['threads']} | {r['global_batch']} | {r['samples_per_s']:,.0f} | "
            f"{r['samples_per_s_min']:,.0f}–{r['samples_per_s_max']:,.0f} | {eff} | "
            f"{_pct(r['comm_fraction'])} | {_pct(r['wait_fraction'])} | "
            f"{_bytes(r.get('bytes_per_sample'))} |")
    return "\n".join(lines) + "\n"


def write_outputs(cfg: BenchConfig, rows: list[dict[str, Any]], command: str) -> dict[str, Path]:
    """``bench.csv``, ``bench.md`` and ``bench.png`` in ``cfg.out``."""
    import torch

    from shoal.plots import bench_figure

    cfg.out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": cfg.out / "bench.csv", "md": cfg.out / "bench.md", "png": cfg.out / "bench.png"}
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in CSV_FIELDS})
    where = f"emulated hosts at {cfg.emulate_bandwidth} per link" if cfg.emulate_bandwidth \
        else "local worker processes"
    head = (f"# shoal bench\n\n`{command}`\n\n{len(os.sched_getaffinity(0))} CPU cores, {where}, "
            f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M %Z')}; {cfg.steps} "
            f"steps after {cfg.warmup} warm-up, median of {cfg.repeats}. Efficiency: samples/s "
            "over workers x one worker's samples/s. comm / wait: shares of rank 0's step time.\n\n")
    paths["md"].write_text(head + markdown_table(rows))
    title = f"{', '.join(cfg.models)}; {where}; median of {cfg.repeats}"
    bench_figure(rows, paths["png"], title, dashed=REFERENCE)
    return paths
