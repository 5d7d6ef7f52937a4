"""Run by tests/test_hf_trainer.py on each of 2 processes that ``torchrun`` started.

For each case (a strategy and its options): the README's Trainer example
(examples/hf_trainer_diloco.py, run as a script), then shoal's own loop (`shoal.strategy`)
with the same model, optimizer and seed over the very batches the Trainer trained on (its
own train loader, epoch by epoch). Then a checkpoint: train 20 steps saving at 10, resume a
fresh trainer from step 10. Then what a ShoalTrainer refuses. Every rank writes what it got
to ``OUT/rank<r>.json``.

    torchrun --nproc-per-node 2 tests/hf_trainer_job.py OUT CASES EPOCHS
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

import shoal
from shoal.errors import ShoalError
from shoal.integrations.hf_trainer import STATE_FILE, ShoalCallback, ShoalTrainer

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer_diloco.py"
STREAMING = {"tau": 4, "fragments": 2, "overlap_steps": 1, "outer_precision": "int4"}


def params(module: torch.nn.Module) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in module.parameters()]


def example(out: Path, name: str, options: dict, epochs: int) -> dict:
    sys.argv = [str(EXAMPLE), "--strategy", name, "--options", json.dumps(options),
                "--epochs", str(epochs), "--output-dir", str(out / f"example-{name}")]
    ns = runpy.run_path(str(EXAMPLE), run_name="__main__")
    callback = next(c for c in ns["trainer"].callback_handler.callbacks
                    if isinstance(c, ShoalCallback))
    return {"params": params(ns["trainer"].model), "steps": callback.coupling.steps,
            "accuracy": ns["accuracy"], "ns": ns}


def own_loop(ns: dict, name: str, options: dict, epochs: int) -> dict:
    """shoal's own loop over the batches the example's Trainer trained on."""
    # The Trainer's loader, shuffled from torch's initial seed (the Trainer's seed, 42) as
    # the Trainer's own was: built before the model's seed below changes it.
    loader = ns["trainer"].get_train_dataloader()
    torch.manual_seed(0)
    data = ns["data"]
    model = ns["Classifier"](ns["build_model"]("lenet5", data.input_shape, data.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    strategy = shoal.strategy(name, model, optimizer, **options)
    for epoch in range(epochs):
        loader.set_epoch(epoch)  # as the Trainer does
        for batch in loader:
            strategy.backward(strategy.module(**batch)["loss"])
            strategy.step()
            strategy.zero_grad()
    strategy.end_epoch(strategy.steps)
    return {"params": params(strategy.eval_module), "steps": strategy.steps}


def trainer(ns: dict, out: Path, callbacks: list, cls: type[Trainer] = ShoalTrainer,
            **args: Any) -> Trainer:
    """A trainer of the example's model, data and optimizer, with these arguments."""
    torch.manual_seed(0)
    data = ns["data"]
    model = ns["Classifier"](ns["build_model"]("lenet5", data.input_shape, data.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings = {"per_device_train_batch_size": 16, "lr_scheduler_type": "constant",
                "max_grad_norm": 0.0, "report_to": [], "use_cpu": True, "disable_tqdm": True,
                "save_strategy": "no", **args}
    return cls(model=model, args=TrainingArguments(output_dir=str(out), **settings),
               train_dataset=ns["train"], eval_dataset=ns["train"],
               optimizers=(optimizer, None), callbacks=callbacks)


def checkpoint(ns: dict, out: Path) -> dict:
    """Streaming DiLoCo in int4 with overlap (exchanges in flight, residuals): 20 steps
    saving at 10, then a fresh trainer resumed from step 10."""
    rank = shoal.init().rank
    steps = {"max_steps": 20, "save_strategy": "steps", "save_steps": 10}
    first = trainer(ns, out, [ShoalCallback("diloco", **STREAMING)], **steps)
    first.train()
    saved = torch.load(out / "checkpoint-10" / STATE_FILE, weights_only=True)
    mine, theirs = (saved["ranks"][r]["model"] for r in (rank, 1 - rank))
    again = trainer(ns, out, [ShoalCallback("diloco", **STREAMING)], **steps)
    again.train(resume_from_checkpoint=str(out / "checkpoint-10"))
    return {"first": params(first.model), "again": params(again.model),
            "saved_ranks": len(saved["ranks"]), "saved_steps": saved["steps"],
            "replicas_differ": any(not torch.equal(mine[k], theirs[k]) for k in mine)}


def refusals(ns: dict, out: Path) -> dict:
    """What a ShoalTrainer refuses, each in one line, before it trains."""
    plain = trainer(ns, out / "plain", [], Trainer, max_steps=1, save_strategy="steps",
                    save_steps=1)
    plain.train()  # an HF checkpoint (model, optimizer) without shoal's state
    cases: dict[str, tuple[list, type[Trainer], dict]] = {
        "async-sgd": ([ShoalCallback("async-sgd")], ShoalTrainer, {}),
        "eamsgd": ([ShoalCallback("eamsgd")], ShoalTrainer, {}),
        "accumulation": ([ShoalCallback("diloco")], ShoalTrainer,
                         {"gradient_accumulation_steps": 2}),
        "best model": ([ShoalCallback("diloco")], ShoalTrainer,
                       {"load_best_model_at_end": True, "eval_strategy": "steps",
                        "save_strategy": "steps"}),
        "plain Trainer": ([ShoalCallback("diloco")], Trainer, {}),
        "no callback": ([], ShoalTrainer, {}),
        "no saved state": ([ShoalCallback("diloco")], ShoalTrainer,
                           {"resume": str(out / "plain" / "checkpoint-1")}),
    }
    messages = {}
    for case, (callbacks, cls, args) in cases.items():
        resume = args.pop("resume", None)
        try:
            trainer(ns, out / "refused", callbacks, cls, max_steps=1, **args).train(resume)
            messages[case] = "trained"
        except ShoalError as error:
            messages[case] = str(error)
    return messages


def main() -> None:
    out, cases, epochs = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    results: dict[str, Any] = {}
    ns: dict = {}
    for case, (name, options) in cases.items():
        got = example(out, name, options, epochs)
        ns = got.pop("ns")
        results[case] = {"coupling": got, "own": own_loop(ns, name, options, epochs)}
    results["checkpoint"] = checkpoint(ns, out / "checkpoint")
    results["refusals"] = refusals(ns, out)
    (out / f"rank{shoal.init().rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
