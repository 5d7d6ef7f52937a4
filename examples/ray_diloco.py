"""DiLoCo on Ray Train: LeNet-5 on the bundled digits, checkpointed through Ray, resumed on
another number of workers.

    python examples/ray_diloco.py --workers 2 --epochs 2 --storage /tmp/ray-runs
    python examples/ray_diloco.py --workers 1 --epochs 3 --storage /tmp/ray-runs

The second run goes on from the first one's last checkpoint (same ``--name`` and
``--storage``: Ray hands it to ``ray.train.get_checkpoint()``), on one worker. shoal adds
three lines to the ``train_func``, marked below; the loop is shoal's own. ``--strategy``
takes sync, local-sgd, easgd, eamsgd or diloco, ``--options`` the strategy's options as JSON
(``'{"tau": 8, "fragments": 2, "overlap_steps": 1, "outer_precision": "int4"}'``).
"""

import argparse
import json

import ray
import torch
import torch.nn.functional as F
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from shoal.data import load_dataset
from shoal.integrations import ray as shoal_ray
from shoal.models import build_model


def train_func(config: dict) -> None:
    """One Ray Train worker: Ray set up the process group, shoal couples over it."""
    data = load_dataset("digits")  # bundled with shoal: 8x8 handwritten digits
    torch.manual_seed(0)  # every worker starts from the same weights
    model = build_model("lenet5", data.input_shape, data.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    strategy = shoal_ray.strategy(config["strategy"], model, optimizer, **config["options"])  # shoal
    for epoch in range(shoal_ray.resume(strategy), config["epochs"]):  # shoal: from the checkpoint
        for x, y in strategy.batches(data.train, batch_size=16, epoch=epoch):  # this worker's rows
            loss = F.cross_entropy(strategy.module(x), y)
            strategy.backward(loss)
            strategy.step()
            strategy.zero_grad()
        trained = strategy.eval_module.eval()  # DiLoCo's global model, the same on every worker
        with torch.no_grad():
            x, y = (t.to(strategy.comm.device) for t in data.test.get_batch(torch.arange(len(data.test))))
            accuracy = (trained(x).argmax(1) == y).float().mean().item()
        trained.train()
        metrics = {"epoch": epoch + 1, "accuracy": accuracy, "workers": strategy.comm.world_size}
        shoal_ray.report(metrics, strategy, epochs=epoch + 1)  # shoal: every rank's state


def main(argv: list[str] | None = None) -> ray.train.Result:
    """Train (or go on training) on ``--workers`` Ray Train workers; the run's result."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--strategy", default="diloco")
    parser.add_argument("--options", type=json.loads, default={"tau": 8})
    parser.add_argument("--name", default="shoal-ray-diloco")
    parser.add_argument("--storage", default="/tmp/ray-runs", help="where Ray keeps checkpoints")
    args = parser.parse_args(argv)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"strategy": args.strategy, "options": args.options, "epochs": args.epochs},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=torch.cuda.is_available()),
        run_config=RunConfig(name=args.name, storage_path=args.storage))
    result = trainer.fit()
    print(f"{args.strategy} on {args.workers} Ray workers: test accuracy "
          f"{100 * result.metrics['accuracy']:.1f}% after {result.metrics['epoch']} epochs")
    return result


if __name__ == "__main__":
    main()
