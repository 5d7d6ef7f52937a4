"""A finished run's numbers, and a point's repeats summarized.

Throughput is rank 0's samples over wall-clock time between the step record at the end of
warm-up and the last one; the time split sums the same records' ``time_s`` and takes its
shares with :mod:`shoal.core.timeline`'s arithmetic, as ``shoal train``'s summary does.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.core.timeline import WAIT, comm_fraction, time_fractions
from shoal.errors import ShoalError
from shoal.sweep.config import Point


def measure_run(out: Path, warmup: int) -> dict[str, float]:
    """Throughput and time split of a finished ``shoal train`` run after ``warmup`` steps."""
    try:
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    except (OSError, ValueError) as exc:
        raise ShoalError(f"benchmark run in {out} left no readable results: {exc}") from None
    steps = [r for r in records if r["event"] == "step"]
    first = next((r for r in steps if r["step"] >= warmup), None)
    last = steps[-1] if steps else None
    if first is None or last is None or last["step"] <= first["step"]:
        raise ShoalError(f"benchmark run in {out} logged no steps after the warm-up")
    samples = (last["step"] - first["step"]) * summary["global_batch"]
    split: dict[str, float] = {}
    for r in steps:
        if r["step"] > first["step"]:
            for k, v in r["time_s"].items():
                split[k] = split.get(k, 0.0) + v
    return {"samples_per_s": samples / (last["elapsed_s"] - first["elapsed_s"]),
            "comm_fraction": comm_fraction(split),
            "wait_fraction": time_fractions(split)[WAIT],
            "bytes_per_sample": summary.get("bytes_per_sample") or 0.0,
            "global_batch": summary["global_batch"]}


def summarize(p: Point, results: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Median and range of a point's repeats: one row of the tables."""
    thr = [r["samples_per_s"] for r in results]
    comm = [r["comm_fraction"] for r in results if "comm_fraction" in r]
    wait = [r["wait_fraction"] for r in results if "wait_fraction" in r]
    sent = [r["bytes_per_sample"] for r in results if "bytes_per_sample" in r]
    return {
        "model": p.model, "strategy": p.strategy_label, "scaling": p.scaling,
        "workers": p.world_size, "threads": p.threads_for(),
        "threads_label": "auto" if p.threads is None else str(p.threads),
        "global_batch": int(results[0]["global_batch"]), "repeats": len(results),
        "samples_per_s": statistics.median(thr), "samples_per_s_min": min(thr),
        "samples_per_s_max": max(thr),
        "comm_fraction": statistics.median(comm) if comm else None,
        "wait_fraction": statistics.median(wait) if wait else None,
        "bytes_per_sample": statistics.median(sent) if sent else None,
        "runs": ";".join(f"{v:.1f}" for v in thr),
    }


def add_efficiency(rows: list[dict[str, Any]]) -> None:
    """Scaling efficiency: samples/s over (workers x the one-worker samples/s) of the same
    model, strategy, scaling and threads setting; ``None`` without a one-worker row."""
    base = {(r["model"], r["strategy"], r["scaling"], r["threads_label"]): r["samples_per_s"]
            for r in rows if r["workers"] == 1}
    for r in rows:
        one = base.get((r["model"], r["strategy"], r["scaling"], r["threads_label"]))
        r["efficiency"] = r["samples_per_s"] / (r["workers"] * one) if one else None
