"""Measuring this machine for the cost model (:class:`~shoal.strategies.cost.Calibration`): the
model's compute per sample (a few timed training steps) and a Gloo all-reduce's latency and
bandwidth between two local processes (started and joined as every shoal job is:
:func:`shoal.core.processes.spawn`, :func:`shoal.core.group.join_group`)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from shoal.errors import ShoalError
from shoal.strategies.cost import Calibration

#: Seconds the calibration's two processes wait for each other at most.
TIMEOUT_S = 60.0


def measure_compute(model: Any, input_shape: Sequence[int], num_classes: int, batch: int,
                    threads: int, steps: int = 8, warmup: int = 3) -> float:
    """Seconds per sample of a training step (forward, backward, SGD step with momentum) of
    ``model`` on random inputs of ``batch`` samples with ``threads`` threads: the median
    of ``steps`` timed steps after ``warmup``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(batch, *input_shape)
        y = torch.randint(0, num_classes, (batch,))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times) / batch


def all_reduce_times(sizes: list[int], reps: int) -> list[float]:
    """The median time of a Gloo all-reduce of each of ``sizes`` bytes, over ``reps`` timed
    ones after a barrier each, among the processes of the job this one belongs to (started
    by :func:`measure_collectives`, or by torchrun across an emulated cluster)."""
    import torch
    import torch.distributed as dist

    from shoal.core.env import detect_environment
    from shoal.core.group import job_store, join_group

    env = detect_environment()
    if env is None:
        raise ShoalError("timing an all-reduce needs a job: run it under spawn or torchrun")
    torch.set_num_threads(1)
    join_group(job_store(env, TIMEOUT_S), env.rank, env.world_size, "cpu", TIMEOUT_S,
               where="the calibration's all-reduce")
    try:
        medians = []
        for n in sizes:
            t = torch.ones(max(1, n // 4))
            for _ in range(3):
                dist.all_reduce(t)
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            medians.append(statistics.median(times))
        return medians
    finally:
        dist.destroy_process_group()


def measure_collectives(nbytes: int, reps: int = 20) -> tuple[float, float]:
    """``(alpha, bytes per second)`` between two local processes, from the median time of a
    Gloo all-reduce of 4 bytes (``2 alpha``, the ring's two messages for ``p = 2``) and of
    :func:`collective_bytes` (``2 alpha + nbytes / bandwidth``)."""
    from shoal.core.processes import spawn

    nbytes = collective_bytes(nbytes)
    return collectives_cost(nbytes, *spawn(2, all_reduce_times, ([4, nbytes], reps))[0])


def collective_bytes(nbytes: int) -> int:
    """The larger message :func:`measure_collectives` times: ``nbytes``, at least 8 MB
    (milliseconds, so that the bytes' time stands well above the latency's noise)."""
    return max(int(nbytes), 8 << 20)


def collectives_cost(nbytes: int, small: float, large: float) -> tuple[float, float]:
    """``(alpha, bytes per second)`` from the times of a 2-process all-reduce of 4 bytes
    (``small``) and of ``nbytes`` (``large``)."""
    if large <= small:
        raise ShoalError(f"calibration: an all-reduce of {nbytes:,} bytes took no longer than "
                         "one of 4 bytes; the machine is too busy to time it (try again)")
    return small / 2, nbytes / (large - small)


def calibrate(cfg: Any, threads: int | None = None) -> tuple[Calibration, int]:
    """Measure ``cfg``'s model (compute per sample at its ``--batch-size``, with ``threads``
    or ``--threads-per-worker`` or all cores) and this machine's collectives; also return
    the model's parameter count."""
    model, shape, classes = model_of(cfg)
    cores = len(os.sched_getaffinity(0))
    threads = threads or cfg.threads_per_worker or cores
    compute = measure_compute(model, shape, classes, cfg.batch_size, threads)
    alpha, host = measure_collectives(4 * parameters(model))
    return Calibration(compute, threads, alpha, host, cores), parameters(model)


def model_of(cfg: Any) -> tuple[Any, tuple[int, ...], int]:
    """``cfg``'s model, its input shape and its number of classes."""
    from shoal.data import load_dataset
    from shoal.models import build_model
    from shoal.train.trainer import data_options

    data = load_dataset(cfg.dataset, data_options(cfg))
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    return model, tuple(data.input_shape), data.num_classes


def parameters(model: Any) -> int:
    """The model's trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
