"""Helpers of the elastic-membership tests (tests/test_elastic.py, tests/test_elastic_join.py)."""

from __future__ import annotations

import collections
import json

EPOCHS, TRAIN_ROWS = 2, 1437  # digits


def samples_trained(out) -> collections.Counter:
    """How often each (epoch, sample) was trained, from every worker's --record-samples."""
    counts: collections.Counter = collections.Counter()
    for path in (out / "samples").glob("worker*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            counts.update((record["epoch"], s) for s in record["samples"])
    return counts


def step_workers(out) -> dict[int, int]:
    """Each step record's ``workers``, by step."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["workers"] for r in records if r.get("event") == "step"}
