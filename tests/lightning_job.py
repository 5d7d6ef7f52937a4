"""Run by tests/test_lightning.py: started once, as rank 0; Lightning's own launcher starts
rank 1 (the first ``fabric.launch()``, ``accelerator="cpu", devices=2``); later Fabric
objects and Trainers run in the same two processes.

On each rank: for each Fabric case a Fabric loop with ``ShoalFabricStrategy``; for each
Trainer case the README's example (examples/lightning_diloco.py, run as a script) with
``ShoalStrategy``; after each, shoal's own loop (`shoal.strategy`) with the same model,
optimizer, seed and batches (Lightning's ``DistributedSampler``, seed 0, each epoch's
``set_epoch``). Then a checkpoint of each: saved with an exchange in flight, resumed, and
trained on as the run it was saved from. Every rank writes what it got to
``OUT/rank<r>.json``.

    python tests/lightning_job.py OUT TRAINER_CASES FABRIC_CASES EPOCHS
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shoal
from shoal.data import load_dataset
from shoal.integrations.lightning import ShoalFabricStrategy, ShoalStrategy
from shoal.models import build_model

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_diloco.py"
#: Streaming DiLoCo in int4 with overlap: a checkpoint after step 9 holds fragment 0's
#: exchange in flight (it starts after steps 1, 5, 9, ...) and the residuals.
STREAMED = {"tau": 4, "fragments": 2, "overlap_steps": 1, "outer_precision": "int4"}
MODULE: list[type[pl.LightningModule]] = []  # the example's LightningModule, once it ran


def params(module: torch.nn.Module) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in module.parameters()]


def rows() -> TensorDataset:
    data = load_dataset("digits")
    return TensorDataset(*data.train.get_batch(torch.arange(len(data.train))))


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The example's model and optimizer, built the same way."""
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("lenet5", data.input_shape, data.num_classes)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def own_loop(name: str, options: dict, epochs: int) -> dict:
    """shoal's own loop over the batches Lightning's sampler gives this rank."""
    model, optimizer = fresh()
    strategy = shoal.strategy(name, model, optimizer, **options)
    dataset = rows()
    sampler = DistributedSampler(dataset, num_replicas=strategy.comm.world_size,
                                 rank=strategy.comm.rank, shuffle=True, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(dataset, batch_size=16, sampler=sampler):
            strategy.backward(F.cross_entropy(strategy.module(x), y))
            strategy.step()
            strategy.zero_grad()
    strategy.end_epoch(strategy.steps)
    return {"params": params(strategy.eval_module), "steps": strategy.steps}


def fabric_loop(name: str, options: dict, epochs: int) -> dict:
    """The Fabric way, with shoal's strategy: its first call launches rank 1."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ShoalFabricStrategy(name, **options))
    fabric.launch()
    model, optimizer = fresh()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(rows(), batch_size=16, shuffle=True))
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            fabric.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    fabric.strategy.finish()
    coupled = fabric.strategy.coupled
    return {"params": params(model), "steps": steps if coupled is None else coupled.steps}


def example(name: str, options: dict, epochs: int) -> dict:
    sys.argv = [str(EXAMPLE), "--strategy", name, "--options", json.dumps(options),
                "--epochs", str(epochs)]
    ns = runpy.run_path(str(EXAMPLE), run_name="__main__")
    MODULE.append(ns["Digits"])
    return {"params": params(ns["model"]), "steps": ns["trainer"].global_step,
            "accuracy": ns["accuracy"]}


def trainer_checkpoint(out: Path) -> dict:
    """Two epochs of 9 steps, checkpointed after the first by ``ModelCheckpoint``; then a
    fresh Trainer resumed from that checkpoint trains the second epoch again."""

    def fit(callbacks: list, ckpt_path: str | None = None) -> pl.Trainer:
        data = load_dataset("digits")
        torch.manual_seed(0)
        module = MODULE[0](data.input_shape, data.num_classes)
        trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=2, limit_train_batches=9,
                             strategy=ShoalStrategy("diloco", **STREAMED), logger=False,
                             callbacks=callbacks, enable_checkpointing=bool(callbacks),
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, DataLoader(rows(), batch_size=16, shuffle=True), ckpt_path=ckpt_path)
        return trainer

    first = fit([ModelCheckpoint(dirpath=out / "trainer", save_top_k=-1)])
    path = out / "trainer" / "epoch=0-step=9.ckpt"
    again = fit([], str(path))
    saved = torch.load(path, weights_only=False)["shoal"]
    rank = first.global_rank
    return {"first": params(first.lightning_module), "again": params(again.lightning_module),
            "steps": again.strategy.coupled.steps, "saved_ranks": len(saved["ranks"]),
            "saved_steps": saved["ranks"][rank]["strategy"]["steps"],
            "saved_pending": sorted(saved["ranks"][rank]["strategy"]["exchanges"]["pending"]),
            "saved_model": params_of(saved["ranks"][rank]["model"])}


def params_of(state: dict) -> list[list[float]]:
    return [t.reshape(-1).tolist() for t in state.values()]


def fabric_checkpoint(out: Path) -> dict:
    """``fabric.save`` after 9 steps (an exchange in flight), 10 steps; ``fabric.load``,
    the same 10 steps again."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ShoalFabricStrategy("diloco", **STREAMED))
    fabric.launch()
    model, optimizer = fresh()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(rows(), batch_size=16, shuffle=True))
    batches = [b for _, b in zip(range(19), loader, strict=False)]

    def train(some: list) -> list:
        for x, y in some:
            fabric.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        return params(model)

    train(batches[:9])
    state = {"model": model, "optimizer": optimizer}
    fabric.save(out / "fabric.ckpt", state)
    first = train(batches[9:])
    fabric.load(out / "fabric.ckpt", state)
    again = train(batches[9:])
    return {"first": first, "again": again, "steps": fabric.strategy.coupled.steps}


def main() -> None:
    out, trainer_cases, fabric_cases = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    epochs = int(sys.argv[4])
    results: dict = {"fabric": {}, "trainer": {}}
    for case, (name, options) in fabric_cases.items():
        results["fabric"][case] = {"coupling": fabric_loop(name, options, epochs),
                                   "own": own_loop(name, options, epochs)}
    argv = list(sys.argv)
    for case, (name, options) in trainer_cases.items():
        results["trainer"][case] = {"coupling": example(name, options, epochs),
                                    "own": own_loop(name, options, epochs)}
    sys.argv = argv
    results["trainer checkpoint"] = trainer_checkpoint(out)
    results["fabric checkpoint"] = fabric_checkpoint(out)
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()  # rank 0 (the process the test waits for) ends after rank 1 wrote


if __name__ == "__main__":
    main()
