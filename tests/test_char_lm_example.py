"""examples/char_lm.py on two real processes (Gloo on CPU): the global model DiLoCo trains
learns the text, both workers end with the same one, and it cost one model per exchange."""

from __future__ import annotations

import collections
import math
import runpy
import sys
from pydoc_data.topics import topics
from typing import Any

import pytest
import torch

import shoal

from conftest import REPO

EXAMPLE = REPO / "examples" / "char_lm.py"
STEPS, TAU = 120, 40  # about 6 s of training on two cores, 3 DiLoCo rounds

pytestmark = pytest.mark.timeout(120)  # spawn stops both workers when the test is stopped


def run_example(argv: list[str]) -> dict[str, Any]:
    """On every rank: the example as ``shoal run`` would run it; what the test checks."""
    sys.argv = [str(EXAMPLE), *argv]
    script = runpy.run_path(str(EXAMPLE), run_name="__main__")
    strategy = script["strategy"]
    return {
        "history": script["history"],
        "theta": torch.cat([p.detach().reshape(-1) for p in strategy.eval_module.parameters()]),
        "steps": strategy.steps,
        "bytes_sent": strategy.comm.bytes_sent,
    }


def held_out_unigram_entropy() -> float:
    """Bits/char of the best model that ignores context, on the tail the example holds out."""
    text = "".join(topics[name] for name in sorted(topics))
    tail = text[int(0.9 * len(text)):]
    counts = collections.Counter(tail)
    return -sum(n / len(tail) * math.log2(n / len(tail)) for n in counts.values())


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    argv = ["--strategy", "diloco", "--steps", str(STEPS), "--tau", str(TAU), "--eval-every", "100"]
    return shoal.launch(run_example, argv, workers=2)


def test_the_global_model_learned_the_text(ranks):
    baseline = held_out_unigram_entropy()  # 4.5 bits/char
    for rank, result in enumerate(ranks):
        assert result["steps"] == STEPS
        (_, first), (_, last) = result["history"][0], result["history"][-1]
        assert last < first, f"rank {rank}: {result['history']}"
        # A full bit under anything a context-free model can reach: it uses the context.
        assert last < baseline - 1.0, f"rank {rank}: {last:.3f} bits/char vs unigram {baseline:.3f}"


def test_both_workers_end_with_the_same_global_model(ranks):
    assert torch.equal(ranks[0]["theta"], ranks[1]["theta"])
    assert ranks[0]["history"] == ranks[1]["history"]


def test_diloco_sends_one_model_per_round(ranks):
    model_bytes = ranks[0]["theta"].numel() * ranks[0]["theta"].element_size()
    for result in ranks:
        # STEPS // TAU pseudo-gradients and the first broadcast of the global model, no more.
        assert 0 < result["bytes_sent"] <= (STEPS // TAU + 1) * model_bytes
