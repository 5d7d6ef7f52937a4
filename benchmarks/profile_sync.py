"""Where a synchronous step's time goes: plain DDP loops and shoal's step, side by side.

One job of ``--workers`` Gloo processes runs, round after round, the same steps of the same
model on the same data in several variants, so that drifts in the machine's speed hit all
alike; each variant reports the median over rounds of rank 0's wall-clock and CPU time per
step (CPU time: all threads of the process, Gloo's included; it barely moves when another
job shares the machine, so small differences in work show where wall time is too noisy):

- ``ddp``: the hand-written loop of ``shoal/sweep/reference.py`` (DDP's defaults);
- ``ddp+bucket-view``: the same with ``gradient_as_bucket_view=True``;
- ``ddp+python-hook``: the same with PyTorch's own ``allreduce_hook`` registered as a
  communication hook (what shoal's ``sync`` did before: a Python hook, however thin);
- ``ddp+bucket-view+python-hook``: both;
- ``shoal``: ``Trainer.train_step`` of ``shoal train --strategy sync`` (data indexing, loss
  weighting, timing spans, scheduler, strategy step), without the outer loop's logging;
- ``shoal+python-hook``: the same with ``allreduce_hook`` registered, as shoal's ``sync``
  registered a Python hook (to count bytes and time the exposed all-reduce) until 2026-11.

    .venv/bin/python benchmarks/profile_sync.py --model benchmarks/models.py:mlp_1024x2 \\
        --shape 784 --batch 64 --steps 60 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import shoal
from shoal.config import TrainConfig
from shoal.core.processes import spawn
from shoal.data import DataOptions, load_dataset
from shoal.sweep.reference import Workload, ddp_step
from shoal.train.trainer import Trainer


def timed(run_step: Callable[[int], None], steps: int, warmup: int) -> tuple[float, float]:
    """Seconds of wall clock and of CPU per step after ``warmup`` steps, between barriers."""
    for step in range(warmup):
        run_step(step)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(warmup, steps):
        run_step(step)
    dist.barrier()
    n = steps - warmup
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def plain_ddp(a: argparse.Namespace, data, view: bool, hook: bool) -> Callable[[int], None]:
    w = Workload(model=a.model, shape=a.shape, batch=a.batch, lr=0.02)
    return ddp_step(w, data, dist.get_rank(), dist.get_world_size(), bucket_view=view,
                    comm_hook=default_hooks.allreduce_hook if hook else None)


def shoal_step(a: argparse.Namespace, comm, out: str, hook: bool = False) -> Callable[[int], None]:
    cfg = TrainConfig(model=a.model, dataset="synthetic", synthetic_shape=a.shape,
                      synthetic_samples=a.steps * a.batch * comm.world_size, epochs=1,
                      batch_size=a.batch, lr=0.02, schedule="constant", progress="none",
                      out=out, workers=comm.world_size)
    trainer = Trainer(cfg, comm)
    if hook:  # as shoal's sync was: a Python hook (PyTorch's own) in DDP's path
        trainer.strategy.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    perm = trainer.plan.permutation(0)

    def run_step(step: int) -> None:
        trainer.state.epoch_step = step
        trainer.train_step(perm)
    return run_step


def job(a: argparse.Namespace) -> None:
    comm = shoal.init(device="cpu")
    data = load_dataset("synthetic", DataOptions(
        synthetic_shape=a.shape, synthetic_samples=a.steps * a.batch * comm.world_size)).train
    with tempfile.TemporaryDirectory() as out:
        variants = {
            "ddp": lambda: plain_ddp(a, data, view=False, hook=False),
            "ddp+bucket-view": lambda: plain_ddp(a, data, view=True, hook=False),
            "ddp+python-hook": lambda: plain_ddp(a, data, view=False, hook=True),
            "ddp+bucket-view+python-hook": lambda: plain_ddp(a, data, view=True, hook=True),
            "shoal": lambda: shoal_step(a, comm, out),
            "shoal+python-hook": lambda: shoal_step(a, comm, out, hook=True),
        }
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for _ in range(a.rounds):
            for name, make in variants.items():
                times[name].append(timed(make(), a.steps, a.warmup))
    if comm.rank == 0:
        base_wall = statistics.median(t[0] for t in times["ddp"])
        base_cpu = statistics.median(t[1] for t in times["ddp"])
        print(f"\n{a.model}, input {'x'.join(map(str, a.shape))}, batch {a.batch}/worker, "
              f"{comm.world_size} workers, {a.steps - a.warmup} timed steps, median of "
              f"{a.rounds} rounds\n")
        print("| variant | wall ms/step | vs ddp | CPU ms/step | vs ddp |")
        print("|---|---:|---:|---:|---:|")
        for name, ts in times.items():
            wall = statistics.median(t[0] for t in ts)
            cpu = statistics.median(t[1] for t in ts)
            print(f"| {name} | {1e3 * wall:.2f} | {wall / base_wall:.3f} | {1e3 * cpu:.2f} | "
                  f"{cpu / base_cpu:.3f} |")
    shoal.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="benchmarks/models.py:mlp_1024x2")
    p.add_argument("--shape", default="784")
    p.add_argument("--batch", type=int, default=64, help="per worker")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    a.shape = tuple(int(d) for d in a.shape.split("x"))
    spawn(a.workers, job, (a,))


if __name__ == "__main__":
    main()
