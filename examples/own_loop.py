"""Your own training loop, data-parallel with any strategy: LeNet-5 on the bundled digits.

    shoal run --workers 2 examples/own_loop.py --strategy easgd

(or ``torchrun --nproc-per-node 2 examples/own_loop.py``). It ends with the same parameters
as ``shoal train --strategy easgd --workers 2 --epochs 3 --schedule constant``.
"""

import argparse

import torch
import torch.nn.functional as F

import shoal
from shoal.data import load_dataset
from shoal.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="sync")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

data = load_dataset("digits")  # bundled with shoal: 8x8 handwritten digits
torch.manual_seed(0)  # every worker starts from the same weights
model = build_model("lenet5", data.input_shape, data.num_classes)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
strategy = shoal.strategy(args.strategy, model, optimizer)
for epoch in range(args.epochs):
    for x, y in strategy.batches(data.train, batch_size=16, epoch=epoch):  # this worker's rows
        loss = F.cross_entropy(strategy.module(x), y)
        strategy.backward(loss)
        strategy.step()
        strategy.zero_grad()

trained = strategy.eval_module.eval()  # the center for EASGD, the global model for DiLoCo
with torch.no_grad():
    x, y = data.test.get_batch(torch.arange(len(data.test)))
    accuracy = (trained(x).argmax(1) == y).float().mean().item()
if strategy.comm.rank == 0:
    print(f"{args.strategy}: test accuracy {100 * accuracy:.1f}% after {args.epochs} epochs")
