"""Run by tests/test_accelerate.py on each of 2 processes that ``accelerate launch`` started.

For each case (a strategy and its options): the README's Accelerate example
(examples/accelerate_diloco.py, run as a script), then shoal's own loop (`shoal.strategy`)
with the same model, optimizer, seed and batches (an Accelerate-prepared loader of the same
shuffle seed). Then a coupling's checkpoint: save, train on, restore, train the same batches
again. Every rank writes what it got to ``OUT/rank<r>.json``.

    accelerate launch --multi_gpu --num_processes 2 tests/accelerate_job.py OUT CASES EPOCHS
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import shoal
from shoal.data import load_dataset
from shoal.integrations.accelerate import Coupling
from shoal.models import build_model

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "accelerate_diloco.py"


def params(module: torch.nn.Module) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in module.parameters()]


def fresh(accelerator: Accelerator) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    """The example's model, optimizer and loader, built the same way."""
    data = load_dataset("digits")
    rows = data.train.get_batch(torch.arange(len(data.train)))
    loader = DataLoader(TensorDataset(*rows), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = build_model("lenet5", data.input_shape, data.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer, accelerator.prepare(loader)


def own_loop(accelerator: Accelerator, name: str, options: dict, epochs: int) -> dict:
    """shoal's own loop over the same batches as the example's."""
    model, optimizer, loader = fresh(accelerator)
    strategy = shoal.strategy(name, model, optimizer, **options)
    for _ in range(epochs):
        for x, y in loader:
            strategy.backward(F.cross_entropy(strategy.module(x), y))
            strategy.step()
            strategy.zero_grad()
    strategy.end_epoch(strategy.steps)
    return {"params": params(strategy.eval_module), "steps": strategy.steps}


def example(name: str, options: dict, epochs: int) -> dict:
    sys.argv = [str(EXAMPLE), "--strategy", name, "--options", json.dumps(options),
                "--epochs", str(epochs)]
    ns = runpy.run_path(str(EXAMPLE), run_name="__main__")
    return {"params": params(ns["accelerator"].unwrap_model(ns["model"])),
            "steps": ns["coupling"].steps, "accuracy": ns["accuracy"],
            "accelerator": ns["accelerator"]}


def checkpoint(out: Path) -> dict:
    """DiLoCo streamed in int4 with overlap (exchanges in flight, residuals): params after
    save, 10 steps; and after restoring that save, the same 10 steps again."""
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = fresh(accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = [b for _, b in zip(range(20), loader, strict=False)]
    options = {"tau": 4, "fragments": 2, "overlap_steps": 1, "outer_precision": "int4"}
    with Coupling(accelerator, model, optimizer, "diloco", **options) as coupling:

        def train(some: list) -> list:
            for x, y in some:
                accelerator.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                coupling.step()
                optimizer.zero_grad()
            return params(accelerator.unwrap_model(model))

        train(batches[:10])
        accelerator.save_state(str(out / "state"))
        first = train(batches[10:])
        accelerator.load_state(str(out / "state"))
        again = train(batches[10:])
    return {"first": first, "again": again, "steps": coupling.steps}


def main() -> None:
    out, cases, epochs = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    results = {}
    for case, (name, options) in cases.items():
        got = example(name, options, epochs)
        results[case] = {"coupling": got, "own": own_loop(got.pop("accelerator"), name, options,
                                                          epochs)}
    results["checkpoint"] = checkpoint(out)
    rank = shoal.init().rank
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
