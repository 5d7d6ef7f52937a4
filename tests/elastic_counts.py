"""What the elastic tests count: every sample of every epoch trained exactly once, from the
workers' ``--record-samples`` files (``OUT/samples/worker<i>.jsonl``)."""

from __future__ import annotations

import collections
import json
from pathlib import Path


def samples_trained(out: Path) -> collections.Counter:
    """How often each (epoch, sample) was trained, from every worker's --record-samples."""
    counts: collections.Counter = collections.Counter()
    for path in (out / "samples").glob("worker*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            counts.update((record["epoch"], s) for s in record["samples"])
    return counts


def assert_each_sample_once(out: Path, epochs: int, rows: int) -> None:
    """Every one of ``rows`` samples of each of ``epochs`` epochs trained exactly once."""
    counts = samples_trained(out)
    twice = [key for key, n in counts.items() if n > 1]
    assert not twice, f"{len(twice)} samples trained more than once, e.g. {twice[:3]}"
    missing = {(e, s) for e in range(epochs) for s in range(rows)} - counts.keys()
    assert not missing, f"{len(missing)} samples never trained, e.g. {sorted(missing)[:3]}"
    assert len(counts) == epochs * rows, "samples outside the training set"
