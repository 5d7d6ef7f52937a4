"""The reference: a minimal hand-written PyTorch DDP training loop.

Only ``torch`` is used in the timed part: ``init_process_group``, ``DistributedDataParallel``,
SGD, cross-entropy. The model architecture and the data come from shoal so that both sides
train exactly the same thing. Throughput is measured on rank 0 between two barriers, after
``warmup`` steps.

Local workers: :func:`run_reference`. Under torchrun (e.g. across the hosts of an emulated
cluster): ``torchrun ... -m shoal.sweep.reference --model lenet5 --out result.json``, with
the flags of :meth:`Workload.flags`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from shoal.core.guard import die_with_parent
from shoal.core.logs import install as install_logging

log = logging.getLogger("shoal.sweep")


@dataclass
class Workload:
    """What both sides train: model on synthetic data of a shape, per-worker batch, steps."""

    model: str = "resnet20"
    shape: tuple[int, ...] = (3, 32, 32)
    classes: int = 10
    batch: int = 32
    steps: int = 60
    warmup: int = 10
    lr: float = 0.05
    momentum: float = 0.9

    def samples(self, world_size: int) -> int:
        return self.steps * self.batch * world_size

    def flags(self) -> list[str]:
        """This workload as flags of ``python -m shoal.sweep.reference`` (:func:`parse_workload`
        reads them back): the loop started under torchrun trains exactly this."""
        return ["--model", self.model, "--shape", "x".join(map(str, self.shape)),
                "--classes", str(self.classes), "--batch", str(self.batch),
                "--steps", str(self.steps), "--warmup", str(self.warmup), "--lr", str(self.lr),
                "--momentum", str(self.momentum)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shoal.sweep.reference", description=__doc__)
    d = Workload()
    p.add_argument("--model", default=d.model)
    p.add_argument("--shape", default="x".join(map(str, d.shape)))
    p.add_argument("--classes", type=int, default=d.classes)
    p.add_argument("--batch", type=int, default=d.batch, help="per worker")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    return p


def parse_workload(argv: Sequence[str]) -> tuple[Workload, argparse.Namespace]:
    """The workload of ``python -m shoal.sweep.reference``'s flags, and all the flags."""
    a = _parser().parse_args(argv)
    w = Workload(model=a.model, shape=tuple(int(v) for v in a.shape.split("x")),
                 classes=a.classes, batch=a.batch, steps=a.steps, warmup=a.warmup, lr=a.lr,
                 momentum=a.momentum)
    return w, a


def _load(w: Workload, world_size: int):
    from shoal.data import DataOptions, load_dataset

    return load_dataset("synthetic", DataOptions(synthetic_shape=w.shape,
                                               synthetic_classes=w.classes,
                                               synthetic_samples=w.samples(world_size)))


def ddp_step(w: Workload, data: Any, rank: int, world_size: int, *, bucket_view: bool = False,
             comm_hook: Callable[..., Any] | None = None) -> Callable[[int], None]:
    """The reference's training step ``step -> None``: DDP with its defaults (or with
    ``gradient_as_bucket_view`` / a communication hook, to measure what they cost), SGD,
    cross-entropy, this rank's slice of the step's global batch of a fixed permutation."""
    from shoal.models import build_model

    torch.manual_seed(0)
    model = build_model(w.model, w.shape, w.classes)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    if comm_hook is not None:
        ddp.register_comm_hook(None, comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=w.lr, momentum=w.momentum)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(data), generator=gen)

    def step(i: int) -> None:
        start = (i * world_size + rank) * w.batch
        x, y = data.get_batch(perm[start : start + w.batch])
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def _train(rank: int, world_size: int, w: Workload, threads: int, out: str) -> None:
    """The timed loop, in a process that has joined a Gloo process group of ``world_size``."""
    torch.set_num_threads(threads)
    step = ddp_step(w, _load(w, world_size).train, rank, world_size)
    t0 = 0.0
    for i in range(w.steps):
        if i == w.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        step(i)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        timed = (w.steps - w.warmup) * w.batch * world_size
        with open(out, "w") as f:
            json.dump({"samples_per_s": timed / elapsed, "seconds": elapsed}, f)


def _worker(rank: int, parent: int, world_size: int, port: int, w: Workload, threads: int,
            out: str) -> None:
    die_with_parent(parent)  # torch's spawn does not end its processes with this one
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    _train(rank, world_size, w, threads, out)
    dist.destroy_process_group()


def run_reference(w: Workload, world_size: int, threads: int, out: str) -> dict:
    """Run the plain DDP loop on ``world_size`` local processes; return its throughput."""
    from shoal.core.env import free_port

    try:
        mp.spawn(_worker, args=(os.getpid(), world_size, free_port(), w, threads, out),
                 nprocs=world_size)
    except mp.ProcessExitedException as exc:
        # Rank 0 writes the result after the last barrier: with it, every rank finished the
        # timed loop and the crash came in torch's teardown (seen once: "terminate called
        # without an active exception", SIGABRT), as with shoal's own ranks (exit_status).
        if not os.path.exists(out):
            raise
        log.warning(f"shoal: the DDP reference's {exc} after its timed loop; its result stands")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return {**result, "workload": asdict(w)}


def main(argv: list[str] | None = None) -> int:
    """One rank of the reference loop under torchrun; rank 0 writes ``--out``."""
    w, a = parse_workload(sys.argv[1:] if argv is None else argv)
    install_logging()  # its lines as the command's
    dist.init_process_group("gloo")
    try:
        _train(dist.get_rank(), dist.get_world_size(), w, a.threads, a.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
