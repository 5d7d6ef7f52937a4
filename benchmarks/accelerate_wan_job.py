"""One run of benchmarks/accelerate_wan.py: the same Accelerate script, four couplings.

Started by torchrun on each emulated host (one process a host). It trains an MLP on the
bundled digits for ``--steps`` optimizer steps with AdamW, coupled one of four ways:

- ``ddp``: Accelerate's default (DDP all-reduces gradients every step; shoal's ``sync``);
- ``localsgd``: ``accelerate.local_sgd.LocalSGD(accelerator, model, local_sgd_steps=tau)``;
- ``diloco``: ``shoal.integrations.accelerate.Coupling(..., "diloco", tau=tau)``;
- ``diloco-int4``: the same, streamed: ``fragments=2, overlap_steps=1, outer_precision="int4"``.

Rank 0 writes one JSON object to ``--json``: loop seconds, samples/s (all ranks), the bytes
its link sent and received during the loop (the counters of ``GLOO_SOCKET_IFNAME``, read in
its own network namespace), the test accuracy and loss of the trained model.

    torchrun ... benchmarks/accelerate_wan_job.py --coupling diloco --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from torch.utils.data import DataLoader, TensorDataset

from shoal.data import load_dataset
from shoal.integrations.accelerate import Coupling
from shoal.models.small import MLP

COUPLINGS = ("ddp", "localsgd", "diloco", "diloco-int4")
STREAM_INT4 = {"fragments": 2, "overlap_steps": 1, "outer_precision": "int4"}


class _Plain:
    """DDP as Accelerate runs it by default: nothing to add to the loop."""

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self) -> None:
        """Nothing: DDP all-reduced the gradients in backward."""


def coupling(name: str, accelerator: Accelerator, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, tau: int) -> contextlib.AbstractContextManager:
    """The coupling ``name`` of the job's prepared model and optimizer."""
    if name == "localsgd":
        return LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=tau)
    if name == "diloco":
        return Coupling(accelerator, model, optimizer, "diloco", tau=tau)
    if name == "diloco-int4":
        return Coupling(accelerator, model, optimizer, "diloco", tau=tau, **STREAM_INT4)
    return _Plain()


def link_bytes() -> tuple[int, int]:
    """Bytes sent and received so far on this host's link (its namespace's view of /sys)."""
    stats = Path("/sys/class/net") / os.environ.get("GLOO_SOCKET_IFNAME", "lo") / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coupling", choices=COUPLINGS, required=True)
    p.add_argument("--steps", type=int, default=80, help="optimizer steps on every process")
    p.add_argument("--tau", type=int, default=8, help="local steps between exchanges")
    p.add_argument("--width", type=int, default=768, help="the MLP's hidden width")
    p.add_argument("--depth", type=int, default=3, help="the MLP's hidden layers")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--json", type=Path, required=True, help="rank 0 writes its numbers here")
    a = p.parse_args()
    torch.set_num_threads(1)  # each emulated host has one core's share of the machine

    data = load_dataset("digits")
    rows = data.train.get_batch(torch.arange(len(data.train)))
    loader = DataLoader(TensorDataset(*rows), batch_size=a.batch_size, shuffle=True,
                        drop_last=True, generator=torch.Generator().manual_seed(0))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)  # every process starts from the same weights
    model = MLP(data.input_shape, data.num_classes, width=a.width, depth=a.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    couple = coupling(a.coupling, accelerator, model, optimizer, a.tau)

    accelerator.wait_for_everyone()
    sent0, got0 = link_bytes()
    start = time.perf_counter()
    steps = 0
    with couple as c:  # the two lines LocalSGD and shoal's Coupling both add
        while steps < a.steps:
            for x, y in loader:
                accelerator.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                c.step()
                optimizer.zero_grad()
                steps += 1
                if steps == a.steps:
                    break
    seconds = time.perf_counter() - start
    sent1, got1 = link_bytes()

    trained = accelerator.unwrap_model(model).eval()
    with torch.no_grad():
        x, y = data.test.get_batch(torch.arange(len(data.test)))
        out = trained(x)
        accuracy = (out.argmax(1) == y).float().mean().item()
        loss = F.cross_entropy(out, y).item()
    if accelerator.is_main_process:
        parameters = sum(t.numel() for t in trained.parameters())
        a.json.write_text(json.dumps({
            "coupling": a.coupling, "steps": steps, "parameters": parameters,
            "world": accelerator.num_processes, "seconds": seconds,
            "samples_per_s": steps * a.batch_size * accelerator.num_processes / seconds,
            "loop_sent": sent1 - sent0, "loop_received": got1 - got0,
            "test_accuracy": accuracy, "test_loss": loss}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
