"""The strategy of docs/write-a-strategy.md (examples/half_precision_averaging.py) works in a
user's own loop and, unchanged, in `shoal train` by file path."""

import json
from pathlib import Path

import pytest
import torch

import shoal
from shoal.core.processes import spawn
from shoal.loading import load_object
from shoal.strategies import get_strategy

from conftest import REPO, train_here

EXAMPLE = f"{REPO / 'examples' / 'half_precision_averaging.py'}:HalfPrecisionAveraging"
STEPS, BATCH, TAU = 12, 16, 4


def run_both(out_dir: str) -> None:
    """Train the same problem with the example and with built-in local SGD."""
    comm = shoal.init(device="cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 8, generator=gen)
    y = x @ torch.randn(8, generator=gen)
    result = {}
    for name in ("local-sgd", EXAMPLE):
        cls = get_strategy(name) if ":" not in name else load_object(name, "strategy")
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        strategy = cls(model, optimizer, comm, cls.Options(tau=TAU))
        before = comm.bytes_sent  # the exchanges' bytes, not local SGD's starting broadcast
        for step in range(STEPS):
            lo = step * BATCH + comm.rank * BATCH // 2
            batch = slice(lo, lo + BATCH // 2)
            strategy.backward(torch.nn.functional.mse_loss(strategy.module(x[batch]).squeeze(1),
                                                           y[batch]))
            strategy.step()
            strategy.zero_grad()
        result[cls.name] = {"params": torch.cat([p.detach().reshape(-1) for p in
                                                 model.parameters()]).tolist(),
                            "bytes": comm.bytes_sent - before}
    Path(out_dir, f"rank{comm.rank}.json").write_text(json.dumps(result))
    shoal.shutdown()


def test_example_strategy_in_a_user_loop(tmp_path):
    spawn(2, run_both, (str(tmp_path),))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in ranks:
        local, half = res["local-sgd"], res["half-precision-averaging"]
        assert half["bytes"] * 2 == local["bytes"] > 0  # bfloat16: half the bytes
        # Same trajectory as full-precision local SGD, up to bfloat16 rounding.
        torch.testing.assert_close(torch.tensor(half["params"]), torch.tensor(local["params"]),
                                   atol=2e-2, rtol=2e-2)
    # STEPS is a multiple of TAU: both workers end on the same average.
    assert ranks[0]["half-precision-averaging"]["params"] == \
        ranks[1]["half-precision-averaging"]["params"]


def test_example_strategy_plugs_into_shoal_train(tmp_path):
    summary = train_here(tmp_path, "--strategy", EXAMPLE, "--workers", "2", "--tau", "4",
                         "--epochs", "5")
    assert summary["test_accuracy"] >= 0.9
    full_precision = 2 * 4 * summary["parameters"] / (4 * 32)  # as local SGD would send
    assert summary["bytes_per_sample"] == pytest.approx(full_precision / 2, rel=0.05)


def test_example_strategy_states_what_it_sends():
    """The example's pattern says what the test above measures: half local SGD's bytes,
    every tau steps; shoal plan's cost model prices it from that."""
    from shoal.strategies.cost import Link, step_cost

    example, local = load_object(EXAMPLE, "strategy"), get_strategy("local-sgd")
    mine = example.communication(example.Options(tau=TAU), 2)
    theirs = local.communication(local.Options(tau=TAU), 2)
    assert mine.every == theirs.every == TAU
    link = Link(alpha=0.0, beta=1e-8)
    assert step_cost(mine, 2, 1e-3, 1e6, link).bytes_per_step == pytest.approx(
        step_cost(theirs, 2, 1e-3, 1e6, link).bytes_per_step / 2)
