"""DiLoCo in a Hugging Face Trainer: LeNet-5 on the bundled digits.

    torchrun --nproc-per-node 2 examples/hf_trainer_diloco.py

(or ``accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer_diloco.py``;
without GPUs the processes train on the CPU, over Gloo.) shoal changes two lines of a
Trainer script, marked below; ``--strategy`` takes sync, local-sgd, easgd or diloco,
``--options`` the strategy's options as JSON
(``'{"tau": 8, "fragments": 2, "overlap_steps": 1, "outer_precision": "int4"}'``).
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainingArguments

from shoal.data import load_dataset
from shoal.integrations.hf_trainer import ShoalCallback, ShoalTrainer
from shoal.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="diloco")
parser.add_argument("--options", type=json.loads, default={"tau": 8})
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--output-dir", default="hf_trainer_diloco")
args = parser.parse_args()


class Classifier(nn.Module):
    """LeNet-5 as the Trainer calls a model: the batch's fields in, a dict with the loss out."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.net(x)
        return {"logits": logits} if labels is None else {
            "loss": F.cross_entropy(logits, labels), "logits": logits}


data = load_dataset("digits")  # bundled with shoal: 8x8 handwritten digits
rows = data.train.get_batch(torch.arange(len(data.train)))
train = [{"x": x, "labels": y} for x, y in zip(*rows, strict=True)]  # the Trainer's fields
torch.manual_seed(0)  # every process starts from the same weights
model = Classifier(build_model("lenet5", data.input_shape, data.num_classes))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
training = TrainingArguments(
    output_dir=args.output_dir, per_device_train_batch_size=16, num_train_epochs=args.epochs,
    lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no", report_to=[],
    use_cpu=not torch.cuda.is_available())
trainer = ShoalTrainer(  # shoal: in place of Trainer
    model=model, args=training, train_dataset=train, optimizers=(optimizer, None),
    callbacks=[ShoalCallback(args.strategy, **args.options)])  # shoal: the strategy
trainer.train()

trained = trainer.model.eval()  # DiLoCo's global model, on every process
with torch.no_grad():
    x, y = data.test.get_batch(torch.arange(len(data.test)))
    device = trainer.args.device
    accuracy = (trained(x.to(device))["logits"].argmax(1) == y.to(device)).float().mean().item()
if trainer.is_world_process_zero():
    print(f"{args.strategy}: test accuracy {100 * accuracy:.1f}% after {args.epochs} epochs")
