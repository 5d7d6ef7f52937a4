"""The README's own loop (examples/own_loop.py), copied verbatim, ends with the same
parameters as ``shoal train`` for every strategy: same data in the same order, the uneven
last batch weighted alike, the epoch-end exchanges done inside ``strategy.batches``."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

import shoal
from shoal.config import TrainConfig
from shoal.core.processes import spawn
from shoal.strategies import STRATEGIES
from shoal.train.trainer import Trainer

from conftest import REPO

EXAMPLE = REPO / "examples" / "own_loop.py"
BUILT_IN = ["sync", "local-sgd", "easgd", "eamsgd", "diloco"]
EPOCHS = 3


def example_code() -> str:
    """The example without its module docstring."""
    text = EXAMPLE.read_text()
    return text[text.index('"""', 3) + 3:].strip()


def test_readme_shows_the_example_verbatim():
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert example_code() in [b.strip() for b in blocks]


def test_every_strategy_is_covered():
    # The asynchronous ones train through parameter servers (tests/test_async_*.py).
    synchronous = [n for n, cls in STRATEGIES.items() if not cls.topology(cls.Options(), 2).servers]
    assert sorted(BUILT_IN) == sorted(synchronous)


def params(module: torch.nn.Module) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in module.parameters()]


def both_ways(out_dir: str) -> None:
    """On every rank: each strategy through shoal train's Trainer, then through the example."""
    comm = shoal.init(device="cpu")
    results = {}
    for name in BUILT_IN:
        cfg = TrainConfig(model="lenet5", dataset="digits", strategy=name, epochs=EPOCHS,
                          batch_size=16, lr=0.05, momentum=0.9, schedule="constant",
                          progress="none", out=str(Path(out_dir, name)), workers=comm.world_size)
        trainer = Trainer(cfg, comm)
        trainer.run()
        sys.argv = [str(EXAMPLE), "--strategy", name, "--epochs", str(EPOCHS)]
        loop = runpy.run_path(str(EXAMPLE), run_name="__main__")
        results[name] = {
            "train": {"worker": params(trainer.model), "eval": params(trainer.strategy.eval_module)},
            "loop": {"worker": params(loop["model"]), "eval": params(loop["strategy"].eval_module)},
            "steps": [trainer.strategy.steps, loop["strategy"].steps],
        }
    Path(out_dir, f"rank{comm.rank}.json").write_text(json.dumps(results))
    shoal.shutdown()


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("own-loop")
    spawn(2, both_ways, (str(out),))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", BUILT_IN)
def test_own_loop_equals_shoal_train(compared, name):
    for rank, results in enumerate(compared):
        got = results[name]
        steps, _ = got["steps"]
        assert got["steps"] == [steps, steps] and steps == EPOCHS * 45  # 1437 rows, 32 a step
        for which in ("worker", "eval"):
            for a, b in zip(got["train"][which], got["loop"][which], strict=True):
                torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=0, rtol=0,
                                           msg=f"rank {rank}: {which} parameters of {name}")
