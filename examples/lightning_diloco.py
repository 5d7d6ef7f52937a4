"""DiLoCo in a Lightning Trainer: LeNet-5 on the bundled digits.

    python examples/lightning_diloco.py

(Lightning's own launcher starts the second process: ``devices=2`` on the CPU, over Gloo.)
shoal adds one argument to the ``Trainer``, marked below; ``--strategy`` takes sync,
local-sgd, easgd or diloco, ``--options`` the strategy's options as JSON
(``'{"tau": 8, "fragments": 2, "overlap_steps": 1, "outer_precision": "int4"}'``).
"""

import argparse
import json

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from shoal.data import load_dataset
from shoal.integrations.lightning import ShoalStrategy
from shoal.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="diloco")
parser.add_argument("--options", type=json.loads, default={"tau": 8})
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--devices", type=int, default=2)
args = parser.parse_args()


class Digits(pl.LightningModule):
    """LeNet-5 trained by SGD with momentum."""

    def __init__(self, input_shape: tuple, num_classes: int) -> None:
        super().__init__()
        self.net = build_model("lenet5", input_shape, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


data = load_dataset("digits")  # bundled with shoal: 8x8 handwritten digits
rows = data.train.get_batch(torch.arange(len(data.train)))
loader = DataLoader(TensorDataset(*rows), batch_size=16, shuffle=True)  # Lightning shards it
torch.manual_seed(0)  # every process starts from the same weights
model = Digits(data.input_shape, data.num_classes)
trainer = pl.Trainer(accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
                     strategy=ShoalStrategy(args.strategy, **args.options),  # shoal
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, loader)

trained = model.eval()  # DiLoCo's global model, on every process
with torch.no_grad():
    x, y = data.test.get_batch(torch.arange(len(data.test)))
    accuracy = (trained(x).argmax(1) == y).float().mean().item()
if trainer.is_global_zero:
    print(f"{args.strategy}: test accuracy {100 * accuracy:.1f}% after {args.epochs} epochs")
