"""The sweep's rows as files: ``bench.csv``, ``bench.md`` (markdown table) and ``bench.png``."""

from __future__ import annotations

import csv
import math
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
#: A race's columns (time to accuracy, accuracy at the budget).
RACE_FIELDS = ("model", "strategy", "scaling", "workers", "processes", "threads",
               "threads_label", "global_batch", "repeats", "time_to_target", "time_to_target_min",
               "time_to_target_max", "reached", "speedup", "baseline", "budget_s",
               "accuracy_at_budget", "accuracy_at_budget_min", "accuracy_at_budget_max",
               "final_accuracy", "train_time_s", "samples_per_s", "comm_fraction",
               "wait_fraction", "bytes_per_sample")
#: On an emulated cluster: who runs on each host, and how fast (:meth:`BenchConfig.hosts_label`).
HOSTS_FIELD = "hosts"


def _pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.0f}%"


def _bytes(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}"


def _seconds(v: float | None) -> str:
    return "" if v is None else ("never" if math.isinf(v) else f"{v:.2f}")


def race_table(rows: Sequence[dict[str, Any]], target: float | None) -> str:
    """A race's results as a markdown table: medians with the repeats' range."""
    goal = f"{100 * target:g}%" if target is not None else "the target"
    budget = rows[0]["budget_s"] if rows else 0.0
    baseline = rows[0]["baseline"] if rows else ""
    lines = [f"| model | strategy | workers | processes | global batch | time to {goal} (s) | range "
             f"| reached | speed-up vs {baseline} | test acc at {budget:.2f} s | range | "
             "final test acc | samples/s | comm | bytes/sample |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        reached = "" if r.get("reached") is None else f"{r['reached']}/{r['repeats']}"
        spread = "" if r.get("time_to_target") is None else \
            f"{_seconds(r['time_to_target_min'])}–{_seconds(r['time_to_target_max'])}"
        at = "" if r["accuracy_at_budget_min"] is None else \
            f"{_pct1(r['accuracy_at_budget_min'])}–{_pct1(r['accuracy_at_budget_max'])}"
        speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['workers']} | {r['processes']} | "
            f"{r['global_batch']} | {_seconds(r.get('time_to_target'))} | {spread} | {reached} | "
            f"{speedup} | {_pct1(r['accuracy_at_budget'])} | {at} | {_pct1(r['final_accuracy'])} | "
            f"{r['samples_per_s']:,.0f} | {_pct(r['comm_fraction'])} | "
            f"{_bytes(r.get('bytes_per_sample'))} |")
    return _with_hosts(lines, rows)


def _with_hosts(lines: list[str], rows: Sequence[dict[str, Any]]) -> str:
    """The table's ``lines`` (header, rule, one per row), with the hosts' column when the
    rows ran on an emulated cluster."""
    if rows and HOSTS_FIELD in rows[0]:
        lines[0] += " hosts (cores, link) |"
        lines[1] += "---|"
        lines[2:] = [f"{line} {r[HOSTS_FIELD]} |" for line, r in zip(lines[2:], rows, strict=True)]
    return "\n".join(lines) + "\n"


def _pct1(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.1f}%"


def markdown_table(rows: Sequence[dict[str, Any]], cfg: BenchConfig | None = None) -> str:
    """The results as a markdown table (throughput median with the repeats' range; a race's
    with :func:`race_table`)."""
    if cfg is not None and cfg.race:
        return race_table(rows, cfg.target_accuracy)
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
    return _with_hosts(lines, rows)


def write_outputs(cfg: BenchConfig, rows: list[dict[str, Any]], command: str,
                  results: dict[Any, list[dict[str, Any]]] | None = None) -> dict[str, Path]:
    """``bench.csv``, ``bench.md`` and ``bench.png`` in ``cfg.out`` (a race's figure: test
    accuracy against training time, from each run's ``curve`` in ``results``)."""
    import torch

    from shoal.plots import bench_figure, race_figure

    cfg.out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": cfg.out / "bench.csv", "md": cfg.out / "bench.md", "png": cfg.out / "bench.png"}
    fields = (RACE_FIELDS if cfg.race else CSV_FIELDS) + \
        ((HOSTS_FIELD,) if cfg.emulate_bandwidth is not None else ())
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in fields})
    where = f"emulated hosts at {cfg.emulate_bandwidth} per link" if cfg.emulate_bandwidth \
        else "local worker processes"
    if cfg.emulate_slow or cfg.emulate_link_rate:
        uneven = [f"host {h} at {f:g} of a core" for h, f in sorted(cfg.emulate_slow.items())]
        uneven += [f"host {h}'s link at {r}" for h, r in sorted(cfg.emulate_link_rate.items())]
        where += f" ({', '.join(uneven)})"
    machine = (f"{len(os.sched_getaffinity(0))} CPU cores, {where}, torch {torch.__version__}, "
               f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    if cfg.race:
        what = (f"{cfg.epochs} epochs of {cfg.dataset}, tested after each; times are training "
                "time (the records' elapsed_s, process start-up excluded); median of "
                f"{cfg.repeats}. Speed-up: the first strategy's time to the target over this "
                "one's. comm: share of the step time over the whole run.")
    else:
        what = (f"{cfg.steps} steps after {cfg.warmup} warm-up, median of {cfg.repeats}. "
                "Efficiency: samples/s over workers x one worker's samples/s. comm / wait: "
                "shares of rank 0's step time.")
    paths["md"].write_text(f"# shoal bench\n\n`{command}`\n\n{machine}; {what}\n\n"
                           + markdown_table(rows, cfg))
    title = f"{', '.join(cfg.models)}; {where}; median of {cfg.repeats}"
    if cfg.race:
        race_figure(rows, results or {}, paths["png"], title, cfg.target_accuracy)
    else:
        bench_figure(rows, paths["png"], title, dashed=REFERENCE)
    return paths
