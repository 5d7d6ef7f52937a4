"""Synchronous data parallelism: gradient averaging with PyTorch DistributedDataParallel.

DDP buckets the gradients and all-reduces each bucket while backward is still computing the
rest. Over Gloo shoal leaves that path exactly as PyTorch runs it: without compression it
registers no communication hook at all, because any Python hook (even PyTorch's own ``allreduce_hook``)
replaces DDP's fused "divide by the world size while copying into the bucket" with a copy
and a separate division pass over every gradient, which cost 4-5% of the step's CPU time
on a communication-bound MLP (docs/ddp-parity.md). The bytes sent are counted from the gradients'
sizes, and a timestamp hook on each parameter's gradient accumulation marks when the last
gradient became ready: the time from there to the end of backward is the all-reduce that
compute did not hide (the ``comm`` part of the step). Compression (fp16, bf16, PowerSGD)
uses the hooks of :mod:`shoal.strategies.sync_hooks`, which count what they send.

``--intra-host auto`` (the default; ``shm`` insists) on a job whose ranks share one host sums
the buckets through the host's shared memory instead of Gloo's loopback TCP
(:mod:`shoal.core.hostpath`, :mod:`shoal.core.intrahost`), in a hook that returns once the
sum is done: the hook's extra pass is far cheaper than the Gloo all-reduce it replaces (docs/performance.md).

With ``--split-wait`` that exposed tail is split into ``wait`` (for the slowest rank to
finish its backward) and ``comm`` (the transfer itself): every rank shares, in a tiny
asynchronous all-reduce settled one step later, how long after the previous step's
all-reduce its last gradient was ready. The slowest rank's lead over this one is time
this one spent waiting, not sending. It is off by default: on a 100 Mbit/s link the extra
message per step cost about 8% of the throughput.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shoal.core.comm import Handle
from shoal.core.dynamo import ddp_settings, defer_disable
from shoal.core.hostpath import HELP, MODES, check_mode, use_host_memory
from shoal.core.intrahost import Summing
from shoal.core.timeline import Event
from shoal.errors import ShoalError
from shoal.strategies.base import Strategy
from shoal.strategies.communication import Exchange, Pattern
from shoal.strategies.registry import register
from shoal.strategies.sync_hooks import (
    PowerSGDMemory,
    compress_hook,
    powersgd_hook,
    shared_memory_hook,
)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


@dataclass
class SyncOptions:
    bucket_mb: float = field(default=25.0, metadata={"help": "DDP gradient bucket size in MiB"})
    compress: str = field(default="none", metadata={
        "help": "gradient compression hook: none, fp16, bf16 or powersgd", "choices": COMPRESSIONS})
    powersgd_rank: int = field(default=1, metadata={"help": "PowerSGD matrix approximation rank"})
    powersgd_warmup: int = field(default=10, metadata={
        "help": "steps of plain allreduce before PowerSGD compression starts"})
    intra_host: str = field(default="auto", metadata={
        "help": HELP + "; --compress keeps gloo", "choices": MODES})
    split_wait: bool = field(default=False, metadata={
        "help": "split the exposed all-reduce into waiting for the slowest rank's backward "
                "and transfer (one 8-byte all-reduce per step)"})

    def validate(self) -> None:
        if self.bucket_mb <= 0:
            raise ShoalError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        if self.compress not in COMPRESSIONS:
            raise ShoalError(f"--compress must be one of {', '.join(COMPRESSIONS)}, "
                             f"got {self.compress!r}")
        check_mode(self.intra_host)
        if self.intra_host == "shm" and self.compress != "none":
            raise ShoalError("--intra-host shm sums uncompressed gradients; "
                             f"leave out --compress {self.compress} or use --intra-host gloo")
        if self.powersgd_rank < 1:
            raise ShoalError(f"--powersgd-rank must be >= 1, got {self.powersgd_rank}")
        if self.powersgd_warmup < 0:
            raise ShoalError(f"--powersgd-warmup must be >= 0, got {self.powersgd_warmup}")


defer_disable(DistributedDataParallel)  # its forward's wrapper would import torch._dynamo

#: DDP told not to broadcast the buffers at each forward (torch 2.13 renamed the flag).
_NO_FORWARD_BUFFERS = {"forward_sync_buffers": False} \
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters \
    else {"broadcast_buffers": False}


@register
class Synchronous(Strategy):
    """Every step, average gradients over all workers (PyTorch DDP)."""

    name = "sync"
    Options = SyncOptions

    @classmethod
    def communication(cls, options: SyncOptions, workers: int) -> Pattern:
        """The gradients' all-reduce every step, half the bytes with a 16-bit hook.
        PowerSGD's share depends on the layers' shapes, which a pattern does not see: it is
        priced uncompressed (an upper bound)."""
        size = 0.5 if options.compress in ("fp16", "bf16") else 1.0
        return Pattern(Exchange.ALL_REDUCE, "gradients", size=size)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm, options=None):
        super().__init__(model, optimizer, comm, options)
        self.ddp: DistributedDataParallel | None = None
        self._last_ready: float | None = None
        self._released: float | None = None  # when the previous step's all-reduce ended
        #: the previous step's wait exchange: (its handle, this rank's lead, exposed event)
        self._pending: tuple[Handle, float, float, Event | None] | None = None
        self._step_bytes = 0  # sent by the all-reduce of one step, when no hook counts it
        self._powersgd: PowerSGDMemory | None = None
        #: PowerSGD's state from a checkpoint, put in place when DDP is wrapped (elastic: late)
        self._powersgd_saved: dict[str, Any] | None = None
        self._stale = False  # the group was re-formed: DDP is wrapped again before forward
        #: DDP rebuilds its buckets at the forward after its first backward (elastic: here)
        self._rebuild: bool | None = None
        self._hooked = False
        self._reducer = self._join_host()
        # Elastic: wrapped at the first forward, a meeting voted on inside a step (a worker
        # lost while the trainers are built is then left like any other); else at once.
        self._stale = comm.membership is not None and comm.active
        if not self._stale:
            self._wrap()

    def _join_host(self) -> Summing | None:
        """The host's shared-memory all-reduce (``--intra-host``), or ``None``: Gloo's."""
        opts: SyncOptions = self.options
        if opts.compress != "none":  # compression asked for: Gloo's hooks, nothing to tell
            return None
        return use_host_memory(self.comm, opts.intra_host)

    def _wrap(self) -> None:
        """Wrap the model in DDP over the job's group (none when alone)."""
        comm, model = self.comm, self.model
        self.ddp, self._stale, self._rebuild = None, False, None
        if not comm.active:
            return
        opts: SyncOptions = self.options
        with ddp_settings():  # its setting read, torch._dynamo not imported (core.dynamo)
            self.ddp = DistributedDataParallel(
                model,
                device_ids=[comm.device.index] if comm.device.type == "cuda" else None,
                bucket_cap_mb=opts.bucket_mb,
                gradient_as_bucket_view=True,
                **({} if comm.membership is None else _NO_FORWARD_BUFFERS),  # _share_buffers
            )
        if comm.membership is not None and self.ddp.modules_buffers:
            self.ddp.register_forward_pre_hook(self._share_buffers)
        params = [p for p in model.parameters() if p.requires_grad]
        if not self._hooked:  # once: the hooks are the parameters', whatever wraps them
            self._hooked = True
            for p in params:
                p.register_post_accumulate_grad_hook(self._gradient_ready)
        if self._reducer is not None:
            self.ddp.register_comm_hook(None, shared_memory_hook(comm, self._reducer))
        elif opts.compress == "none" and comm.membership is None:
            # DDP sends every gradient once a step, as is; with a hook, the hook counts
            # what is actually sent.
            self._step_bytes = sum(p.numel() * p.element_size() for p in params)
        elif opts.compress == "powersgd":
            state, hook, self._powersgd = powersgd_hook(comm, model, opts.powersgd_rank,
                                                        opts.powersgd_warmup)
            if self._powersgd_saved is not None:
                self._powersgd.load_state_dict(self._powersgd_saved)
                self._powersgd_saved = None
            self.ddp.register_comm_hook(state, hook)
        else:
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": None}[opts.compress]
            self.ddp.register_comm_hook(None, compress_hook(comm, dtype))

    @torch.no_grad()
    def _share_buffers(self, module: nn.Module, args: Any) -> None:
        """Elastic: rank 0's buffers (BatchNorm's statistics) to every rank before each
        forward whose gradients are synced, as DDP does it, but as a meeting voted on and
        left at once like the others (DDP's own broadcast is neither: a worker lost there
        failed the job); a failed one re-forms the group and the step is taken again."""
        ddp, membership = self.ddp, self.comm.membership
        assert ddp is not None and membership is not None
        if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync and self.comm.active):
            return
        views = [torch.view_as_real(b) if b.is_complex() else b for b in ddp.modules_buffers]
        flat = torch.cat([v.reshape(-1).to(torch.float64) for v in views])  # ints exact too
        self.comm.count(flat.numel() * flat.element_size())
        with self.comm.track("broadcast", "buffers"):
            membership.watched(dist.broadcast(flat, src=0, async_op=True)).wait()
        for v, part in zip(views, flat.split([v.numel() for v in views]), strict=True):
            v.copy_(part.view_as(v))

    def _gradient_ready(self, param: torch.Tensor) -> None:
        self._last_ready = time.perf_counter()

    def _rewrap(self) -> None:
        """Wrap the model again if the group was re-formed (or never wrapped, elastic):
        DDP's first broadcast is then the group's meeting."""
        if self._stale:
            with self.comm.track("broadcast", "model"):
                self._wrap()

    @property
    def module(self) -> nn.Module:
        self._rewrap()
        if self._rebuild:
            # After its first backward DDP rebuilds its buckets in the order the gradients
            # came, at its next forward, with a broadcast of that order. Elastic: done here
            # instead (as torch's own Join hook does it), a meeting voted on like the others.
            self._rebuild = False
            with self.comm.track("broadcast", "buckets"):
                self.ddp.reducer._rebuild_buckets()
        return self.ddp if self.ddp is not None else self.model

    def no_sync(self, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        if enabled:
            self._rewrap()  # a DDP made by the next forward would not skip this sync
        return self.ddp.no_sync() if enabled and self.ddp is not None \
            else contextlib.nullcontext()

    def loss_weight(self, n_local: int, n_global: int) -> float:
        # DDP averages gradients with equal weights; weighting each rank's mean loss by its
        # share makes uneven last batches give exactly the global-batch gradient.
        return n_local * self.comm.world_size / n_global

    def regroup(self) -> None:
        # PowerSGD starts afresh on every member (warm-up, new factors, no error feedback):
        # a lost worker's residual is gone, a joiner has none, and a meeting that failed
        # part-way may have left the survivors' warm-started factors unequal.
        self._stale, self._powersgd, self._powersgd_saved = True, None, None

    def backward(self, loss: torch.Tensor) -> None:
        self._settle_wait()
        self._last_ready = None
        syncs = self.ddp is not None and self.ddp.require_backward_grad_sync
        # DDP all-reduces the gradients inside backward: a rank that never comes is named.
        with self.comm.track("all_reduce", "gradients") if syncs else contextlib.nullcontext():
            self.weighted(loss).backward()
        if syncs and self._rebuild is None:
            self._rebuild = self.comm.membership is not None
        if not syncs or self._last_ready is None:
            return
        if self._step_bytes:
            self.comm.count(self._step_bytes)
        # Backward returns only when every bucket's all-reduce is done; the time since the
        # last gradient (and so the last bucket) became ready is communication that compute
        # did not hide.
        end = time.perf_counter()
        event = self.comm.book_exposed(self._last_ready, end)
        if self._released is not None and self.options.split_wait:
            mine = self._last_ready - self._released
            ready = torch.tensor([mine], dtype=torch.float64, device=self.comm.device)
            handle = self.comm.all_reduce_async(ready, "max", "share ready time")
            self._pending = (handle, mine, end - self._last_ready, event)
        self._released = end

    def _settle_wait(self) -> None:
        """Book the previous step's wait for the slowest rank (its exchange is done by now)."""
        if self._pending is None:
            return
        handle, mine, exposed, event = self._pending
        self._pending = None
        waited = min(handle.wait().item() - mine, exposed)
        self.comm.book_wait(waited, event)

    def end_epoch(self, epoch: int) -> None:
        self._settle_wait()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.options.compress == "powersgd":
            state["powersgd"] = (self._powersgd.state_dict() if self._powersgd is not None
                                 else self._powersgd_saved or {"world_size": self.comm.world_size})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.options.compress != "powersgd":
            return
        saved = state.get("powersgd")
        if saved is None:
            if self.steps:
                raise ShoalError("checkpoint holds no PowerSGD state (it was written by an "
                                 "older shoal), so the run cannot resume exactly; start afresh")
            return
        if saved["world_size"] != self.comm.world_size:
            raise ShoalError(f"checkpoint holds the PowerSGD state of {saved['world_size']} "
                             f"workers; --compress powersgd resumes exactly only on as many, "
                             f"not {self.comm.world_size}")
        if "iter" not in saved:  # none kept (not wrapped yet, or started afresh): a fresh one
            self._powersgd_saved = None
        elif self._powersgd is not None:
            self._powersgd.load_state_dict(saved)
        else:  # elastic: DDP is wrapped at the first forward
            self._powersgd_saved = saved
