"""A finished run's numbers, and a point's repeats summarized.

Throughput is rank 0's samples over wall-clock time between the step record at the end of
warm-up and the last one; the time split sums the same records' ``time_s`` and takes its
shares with :mod:`shoal.core.timeline`'s arithmetic, as ``shoal train``'s summary does.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.core.timeline import WAIT, comm_fraction, time_fractions
from shoal.errors import ShoalError
from shoal.sweep.config import Point


def _results(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished run's ``summary.json`` and ``metrics.jsonl`` records."""
    try:
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    except (OSError, ValueError) as exc:
        raise ShoalError(f"benchmark run in {out} left no readable results: {exc}") from None
    return summary, records


def measure_run(out: Path, warmup: int) -> dict[str, float]:
    """Throughput and time split of a finished ``shoal train`` run after ``warmup`` steps."""
    summary, records = _results(out)
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


# -- a race: time to accuracy ---------------------------------------------------------------
def measure_race(out: Path, target: float | None) -> dict[str, Any]:
    """A finished run's test accuracy against its training time (``curve``: the epoch and
    ``eval`` records' ``(elapsed_s, test_accuracy)``, in time order: every strategy's
    clock starts when all its workers can train, and ``--eval-every-steps`` tests at the
    same sample counts whatever the strategy), the time it first reached ``target``
    (``inf``: never), its final accuracy and, over the whole run, throughput and time split."""
    summary, records = _results(out)
    curve = sorted((float(r["elapsed_s"]), float(r["test_accuracy"])) for r in records
                   if r["event"] in ("epoch", "eval") and r.get("test_accuracy") is not None
                   and math.isfinite(r["test_accuracy"]))
    if not curve:
        raise ShoalError(f"benchmark run in {out} recorded no test accuracy")
    reached = None if target is None else next((t for t, a in curve if a >= target), math.inf)
    return {"curve": curve, "time_to_target": reached,
            "final_accuracy": float(summary["test_accuracy"]),
            "train_time_s": float(summary["train_time_s"]),
            "samples_per_s": float(summary["samples_per_s"]),
            "comm_fraction": float(summary["comm_fraction"]),
            "wait_fraction": float(summary["wait_fraction"]),
            "bytes_per_sample": float(summary.get("bytes_per_sample") or 0.0),
            "global_batch": summary["global_batch"]}


def accuracy_at(curve: Sequence[tuple[float, float]], budget: float) -> float | None:
    """The test accuracy of the last evaluation at most ``budget`` seconds into the run
    (``None``: none by then)."""
    done = [a for t, a in curve if t <= budget]
    return done[-1] if done else None


def default_budget(results: dict[Point, list[dict[str, Any]]]) -> float:
    """The equal wall-clock budget when none is given: the median time the quickest point
    took to its last evaluation, so that every point is compared at a time all reached."""
    return min(statistics.median(r["curve"][-1][0] for r in runs) for runs in results.values())


def summarize_race(p: Point, results: Sequence[dict[str, Any]], budget: float) -> dict[str, Any]:
    """Medians and ranges of a point's repeats in a race: one row of its table."""
    row = summarize(p, results)
    at = [accuracy_at(r["curve"], budget) for r in results]
    known = [a for a in at if a is not None]
    row.update(processes=p.processes, budget_s=budget,
               final_accuracy=statistics.median(r["final_accuracy"] for r in results),
               accuracy_at_budget=statistics.median(known) if len(known) * 2 > len(at) else None,
               accuracy_at_budget_min=min(known, default=None),
               accuracy_at_budget_max=max(known, default=None),
               train_time_s=statistics.median(r["train_time_s"] for r in results))
    times = [r["time_to_target"] for r in results if r["time_to_target"] is not None]
    if times:
        row.update(time_to_target=statistics.median(times), time_to_target_min=min(times),
                   time_to_target_max=max(times),
                   reached=sum(math.isfinite(t) for t in times))
    return row


def add_speedup(rows: list[dict[str, Any]]) -> None:
    """``speedup``: the first strategy's median time to the target over this row's, among
    rows of the same model, scaling, threads and workers (``None`` where either never
    reached it)."""
    first: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        first.setdefault((r["model"], r["scaling"], r["threads_label"], r["workers"]), r)
    for r in rows:
        base = first[(r["model"], r["scaling"], r["threads_label"], r["workers"])]
        mine, theirs = r.get("time_to_target"), base.get("time_to_target")
        ok = mine is not None and theirs is not None and math.isfinite(mine) \
            and math.isfinite(theirs) and mine > 0
        r["speedup"] = theirs / mine if ok else None
        r["baseline"] = base["strategy"]
