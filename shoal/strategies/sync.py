"""Synchronous data parallelism: gradient averaging with PyTorch DistributedDataParallel.

DDP buckets the gradients and all-reduces each bucket while backward is still computing the
rest. shoal leaves that path exactly as PyTorch runs it: without compression it registers no
communication hook at all, because any Python hook (even PyTorch's own ``allreduce_hook``)
replaces DDP's fused "divide by the world size while copying into the bucket" with a copy
and a separate division pass over every gradient, which cost 4-5% of the step's CPU time
on a communication-bound MLP (docs/ddp-parity.md). The bytes sent are counted from the gradients'
sizes, and a timestamp hook on each parameter's gradient accumulation marks when the last
gradient became ready: the time from there to the end of backward is the all-reduce that
compute did not hide (the ``comm`` part of the step). Compression uses DDP's own hooks
(fp16, bf16, PowerSGD), wrapped to count what they send.

With ``--measure-wait`` that exposed tail is split into ``wait`` (for the slowest rank to
finish its backward) and ``comm`` (the transfer itself): every rank shares, in a tiny
asynchronous all-reduce settled one step later, how long after the previous step's
all-reduce its last gradient was ready. The slowest rank's lead over this one is time
this one spent waiting, not sending. It is off by default: on a 100 Mbit/s link the extra
message per step cost about 8% of the throughput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from shoal.errors import ShoalError
from shoal.strategies.base import Strategy
from shoal.strategies.registry import register

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


@dataclass
class SyncOptions:
    bucket_mb: float = field(default=25.0, metadata={"help": "DDP gradient bucket size in MiB"})
    compress: str = field(default="none", metadata={
        "help": "gradient compression hook: none, fp16, bf16 or powersgd", "choices": COMPRESSIONS})
    powersgd_rank: int = field(default=1, metadata={"help": "PowerSGD matrix approximation rank"})
    powersgd_warmup: int = field(default=10, metadata={
        "help": "steps of plain allreduce before PowerSGD compression starts"})
    measure_wait: bool = field(default=False, metadata={
        "help": "split the exposed all-reduce into waiting for the slowest rank and transfer "
                "(one 8-byte all-reduce per step)"})

    def validate(self) -> None:
        if self.bucket_mb <= 0:
            raise ShoalError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        if self.compress not in COMPRESSIONS:
            raise ShoalError(f"--compress must be one of {', '.join(COMPRESSIONS)}, "
                             f"got {self.compress!r}")
        if self.powersgd_rank < 1:
            raise ShoalError(f"--powersgd-rank must be >= 1, got {self.powersgd_rank}")
        if self.powersgd_warmup < 0:
            raise ShoalError(f"--powersgd-warmup must be >= 0, got {self.powersgd_warmup}")


def _powersgd_bytes(state: powerSGD_hook.PowerSGDState, bucket: Any) -> int:
    """What PowerSGD sends for ``bucket``: low-rank factors P, Q for matrices, the rest raw."""
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return buffer.numel() * buffer.element_size()
    total = 0
    for grad in bucket.gradients():
        if grad.ndim <= 1:
            total += grad.numel()
            continue
        n = grad.shape[0]
        m = grad.numel() // n
        r = min(n, m, state.matrix_approximation_rank)
        compressed = (n + m) * r
        total += compressed if n * m >= state.min_compression_rate * compressed else n * m
    return total * buffer.element_size()


@register
class Synchronous(Strategy):
    """Every step, average gradients over all workers (PyTorch DDP)."""

    name = "sync"
    Options = SyncOptions

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm, options=None):
        super().__init__(model, optimizer, comm, options)
        self.ddp: DistributedDataParallel | None = None
        self._last_ready: float | None = None
        self._released: float | None = None  # when the previous step's all-reduce ended
        self._pending: tuple[Any, torch.Tensor, float, float, Any] | None = None
        self._step_bytes = 0  # sent by the all-reduce of one step, when no hook counts it
        if not comm.active:
            return
        opts: SyncOptions = self.options
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[comm.device.index] if comm.device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_mb,
            gradient_as_bucket_view=True,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)
        if opts.compress == "none":
            # DDP sends every gradient once a step, as is; with compression, the hook below
            # counts what is actually sent.
            self._step_bytes = sum(p.numel() * p.element_size() for p in params)
            return
        if opts.compress == "powersgd":
            state: Any = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=opts.powersgd_rank,
                start_powerSGD_iter=max(1, opts.powersgd_warmup),
            )
            inner, nbytes = powerSGD_hook.powerSGD_hook, lambda b: _powersgd_bytes(state, b)
        else:
            state = None
            inner = {"fp16": default_hooks.fp16_compress_hook,
                     "bf16": default_hooks.bf16_compress_hook}[opts.compress]
            nbytes = lambda b: b.buffer().numel() * 2  # noqa: E731

        # No annotations: DDP checks them at run time against the real classes.
        def counting_hook(hook_state, bucket):  # noqa: ANN001, ANN202
            comm.count(nbytes(bucket))
            return inner(hook_state, bucket)

        self.ddp.register_comm_hook(state, counting_hook)

    def _gradient_ready(self, param: torch.Tensor) -> None:
        self._last_ready = time.perf_counter()

    @property
    def module(self) -> nn.Module:
        return self.ddp if self.ddp is not None else self.model

    def loss_weight(self, n_local: int, n_global: int) -> float:
        # DDP averages gradients with equal weights; weighting each rank's mean loss by its
        # share makes uneven last batches give exactly the global-batch gradient.
        return n_local * self.comm.world_size / n_global

    def backward(self, loss: torch.Tensor) -> None:
        self._settle_wait()
        self._last_ready = None
        syncs = self.ddp is not None and self.ddp.require_backward_grad_sync
        self.weighted(loss).backward()
        if not syncs or self._last_ready is None:
            return
        if self._step_bytes:
            self.comm.count(self._step_bytes)
        # Backward returns only when every bucket's all-reduce is done; the time since the
        # last gradient (and so the last bucket) became ready is communication that compute
        # did not hide.
        end = time.perf_counter()
        event = self.comm.timeline.record("comm", "allreduce", self._last_ready, end)
        if self._released is not None and self.options.measure_wait:
            ready = torch.tensor([self._last_ready - self._released], dtype=torch.float64)
            work = dist.all_reduce(ready, op=dist.ReduceOp.MAX, async_op=True)
            self._pending = (work, ready, self._last_ready - self._released,
                             end - self._last_ready, event)
        self._released = end

    def _settle_wait(self) -> None:
        """Book the previous step's wait for the slowest rank (its exchange is done by now)."""
        if self._pending is None:
            return
        work, slowest, mine, exposed, event = self._pending
        self._pending = None
        work.wait()
        waited = min(slowest.item() - mine, exposed)
        self.comm.timeline.reassign(waited, "comm", "wait", event, "wait for slowest rank")

    def end_epoch(self, epoch: int) -> None:
        self._settle_wait()
