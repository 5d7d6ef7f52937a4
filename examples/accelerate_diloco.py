"""DiLoCo in a Hugging Face Accelerate loop: LeNet-5 on the bundled digits.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_diloco.py

(``--multi_gpu`` starts the processes through torchrun; without GPUs they train on the CPU,
over Gloo.) shoal adds two lines to the loop, marked below; ``--strategy`` takes sync,
local-sgd, easgd or diloco, ``--options`` the strategy's options as JSON
(``'{"tau": 8, "fragments": 2, "overlap_steps": 1, "outer_precision": "int4"}'``).
"""

import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from shoal.data import load_dataset
from shoal.integrations.accelerate import Coupling
from shoal.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="diloco")
parser.add_argument("--options", type=json.loads, default={"tau": 8})
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

data = load_dataset("digits")  # bundled with shoal: 8x8 handwritten digits
rows = data.train.get_batch(torch.arange(len(data.train)))
loader = DataLoader(TensorDataset(*rows), batch_size=16, shuffle=True,
                    generator=torch.Generator().manual_seed(0))
accelerator = Accelerator(cpu=not torch.cuda.is_available())  # Gloo on CPUs
torch.manual_seed(0)  # every process starts from the same weights
model = build_model("lenet5", data.input_shape, data.num_classes)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

with Coupling(accelerator, model, optimizer, args.strategy, **args.options) as coupling:  # shoal
    for _ in range(args.epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            coupling.step()  # shoal: the strategy's exchange, when its schedule says so
            optimizer.zero_grad()

trained = accelerator.unwrap_model(model).eval()  # DiLoCo's global model, on every process
with torch.no_grad():
    x, y = data.test.get_batch(torch.arange(len(data.test)))
    accuracy = (trained(x.to(accelerator.device)).argmax(1) == y.to(accelerator.device))
    accuracy = accuracy.float().mean().item()
accelerator.print(f"{args.strategy}: test accuracy {100 * accuracy:.1f}% after {args.epochs} epochs")
