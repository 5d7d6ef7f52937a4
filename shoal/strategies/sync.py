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
(fp16, bf16, PowerSGD), wrapped to count what they send; PowerSGD's state is kept per
parameter (:class:`PowerSGDMemory`), so checkpoints carry it and a resumed run is exact.

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
from typing import Any, NamedTuple

import numpy as np
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
        compress, full, compressed = powerSGD_hook._should_compress(
            n, m, r, state.min_compression_rate)
        total += compressed if compress else full
    return total * buffer.element_size()


class _Slot(NamedTuple):
    """Where one parameter's PowerSGD state lies in its bucket's tensors."""

    name: str
    offset: int  # in the bucket's flat gradient buffer (and its error-feedback tensor)
    numel: int
    p: tuple[int, int] | None  # (start, length) in the bucket's P memory; None: sent raw
    q: tuple[int, int] | None


class PowerSGDMemory:
    """PowerSGD's state, kept per parameter across DDP's bucketings and across checkpoints.

    DDP's PowerSGD hook keeps its error feedback and its warm-started P and Q factors in
    dicts keyed by bucket index, each a flat tensor laid out as that bucket lays out its
    gradients. A DDP that starts afresh (a resumed run) runs its first step with every
    gradient in one bucket in parameter order and only then rebuilds the buckets in the order
    backward produces them, so a restored state would not line up with the buckets. Before
    the hook sees a bucket, :meth:`align` therefore checks which parameters the bucket holds;
    when they differ from those the state was laid out for, the state of every bucket not yet
    reduced this step is split into per-parameter pieces and reassembled in the new layout.
    Compression works matrix by matrix, so the hook computes exactly what it would have
    computed on the old layout (all-reduces sum element by element: with two workers the
    sums are bit-identical; with more, Gloo may add the ranks' values in another order).
    """

    def __init__(self, state: powerSGD_hook.PowerSGDState, model: nn.Module,
                 world_size: int) -> None:
        self.state = state
        self.world_size = world_size
        self._names = {id(p): name for name, p in model.named_parameters()}
        #: bucket index -> (the parameters it held, their slots) when its state was made
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[_Slot, ...]]] = {}
        #: parameter name -> {"error", "p", "q"}: state not laid out in any bucket yet
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._step_iter = -1
        self._seen: set[int] = set()  # buckets handed to the hook during this step

    def align(self, bucket: Any) -> None:
        """Lay the state out for ``bucket`` before the hook reads it."""
        state = self.state
        if state.iter < state.start_powerSGD_iter:
            return  # warm-up: plain all-reduce, no state read or written
        if state.iter != self._step_iter:  # iter moves on after a step's last bucket
            self._step_iter, self._seen = state.iter, set()
        index = bucket.index()
        params = tuple(map(id, bucket.parameters()))
        known = self._layouts.get(index)
        if known is None or known[0] != params:
            slots = self._slots(bucket)
            for other in [i for i in self._layouts if i not in self._seen]:
                self._pending.update(self._pieces(other, pop=True))
            self._assemble(index, slots, bucket.buffer())
            self._layouts[index] = (params, slots)
        self._seen.add(index)

    def _slots(self, bucket: Any) -> tuple[_Slot, ...]:
        """The layout PowerSGD's hook gives ``bucket``: its gradients one after the other in
        the buffer, P and Q of the matrices it compresses grouped by shape (first seen first)."""
        buffer = bucket.buffer()
        base, size = buffer.data_ptr(), buffer.element_size()
        state = self.state
        rows: list[list[Any]] = []
        groups: dict[tuple[int, int], list[int]] = {}
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            name = self._names.get(id(param))
            if name is None:
                raise ShoalError("PowerSGD: a gradient bucket holds a parameter that is not "
                                 "the model's")
            rows.append([name, (grad.data_ptr() - base) // size, grad.numel(), None, None])
            n = grad.shape[0]
            m = grad.numel() // n
            r = min(n, m, state.matrix_approximation_rank)
            if powerSGD_hook._should_compress(n, m, r, state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append(len(rows) - 1)
        p_at = q_at = 0
        for (n, m), members in groups.items():
            r = min(n, m, state.matrix_approximation_rank)
            for i in members:
                rows[i][3], rows[i][4] = (p_at, n * r), (q_at, m * r)
                p_at, q_at = p_at + n * r, q_at + m * r
        return tuple(_Slot(*row) for row in rows)

    def _pieces(self, index: int, pop: bool) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket ``index``'s state cut into per-parameter copies (``pop``: and dropped)."""
        state = self.state
        take = (lambda d: d.pop(index, None)) if pop else (lambda d: d.get(index))
        params, slots = self._layouts.pop(index) if pop else self._layouts[index]
        error, p, q = take(state.error_dict), take(state.p_memory_dict), take(state.q_memory_dict)
        p_len = sum(s.p[1] for s in slots if s.p is not None)
        q_len = sum(s.q[1] for s in slots if s.q is not None)
        end = max((s.offset + s.numel for s in slots), default=0)
        if ((error is not None and error.numel() < end)
                or (p is not None and p.numel() != p_len) or (q is not None and q.numel() != q_len)):
            raise ShoalError(f"PowerSGD's state of gradient bucket {index} does not have the "
                             "layout its hook gives it; cannot carry it over exactly")
        out: dict[str, dict[str, torch.Tensor]] = {}
        for s in slots:
            piece = {}
            if error is not None:
                piece["error"] = error[s.offset:s.offset + s.numel].clone()
            if s.p is not None and p is not None and q is not None:
                piece["p"] = p[s.p[0]:s.p[0] + s.p[1]].clone()
                piece["q"] = q[s.q[0]:s.q[0] + s.q[1]].clone()
            if piece:
                out[s.name] = piece
        return out

    def _assemble(self, index: int, slots: tuple[_Slot, ...], buffer: torch.Tensor) -> None:
        """Build bucket ``index``'s state from the per-parameter pieces of its parameters."""
        state = self.state
        pieces = [self._pending.get(s.name) for s in slots]
        if all(piece is None for piece in pieces):
            return  # nothing kept: the hook starts this bucket's state itself
        missing = [s.name for s, piece in zip(slots, pieces, strict=True) if piece is None]
        if missing:
            raise ShoalError(f"PowerSGD has no saved state for {missing[0]}, which shares a "
                             "gradient bucket with parameters that have one; cannot continue "
                             "exactly")
        like = {"device": buffer.device, "dtype": buffer.dtype}
        if all("error" in piece for piece in pieces):
            error = torch.zeros(buffer.numel(), **like)
            for s, piece in zip(slots, pieces, strict=True):
                error[s.offset:s.offset + s.numel].copy_(piece["error"])
            state.error_dict[index] = error
        compressed = [(s, piece) for s, piece in zip(slots, pieces, strict=True) if s.p is not None]
        if compressed and all("p" in piece for _, piece in compressed):
            p = torch.empty(sum(s.p[1] for s, _ in compressed), **like)
            q = torch.empty(sum(s.q[1] for s, _ in compressed), **like)
            for s, piece in compressed:
                p[s.p[0]:s.p[0] + s.p[1]].copy_(piece["p"])
                q[s.q[0]:s.q[0] + s.q[1]].copy_(piece["q"])
            state.p_memory_dict[index], state.q_memory_dict[index] = p, q
        for s in slots:
            self._pending.pop(s.name, None)

    def state_dict(self) -> dict[str, Any]:
        """Everything the hook's next step depends on, as tensors, numbers and dicts."""
        state = self.state
        memory = {name: dict(piece) for name, piece in self._pending.items()}
        for index in self._layouts:
            memory.update(self._pieces(index, pop=False))
        kind, keys, pos, has_gauss, cached = state.rng.get_state()
        return {
            "world_size": self.world_size,
            "iter": state.iter,
            "rng": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                    "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
            "memory": memory,
            "stats": [state.total_numel_before_compression,
                      state.total_numel_after_compression, state.next_stats_report],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        unknown = sorted(set(saved["memory"]) - set(self._names.values()))
        if unknown:
            raise ShoalError(f"checkpoint holds PowerSGD state for {unknown[0]!r}, which this "
                             "model does not have")
        state = self.state
        state.iter = int(saved["iter"])
        rng = saved["rng"]
        state.rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["pos"],
                             rng["has_gauss"], rng["cached"]))
        (state.total_numel_before_compression, state.total_numel_after_compression,
         state.next_stats_report) = (int(v) for v in saved["stats"])
        for d in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            d.clear()
        self._layouts.clear()
        self._step_iter, self._seen = -1, set()
        self._pending = {name: dict(piece) for name, piece in saved["memory"].items()}


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
        self._powersgd: PowerSGDMemory | None = None
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
                # With error feedback the hook needs 2 plain steps at least (DDP rebuilds
                # its buckets after the first).
                start_powerSGD_iter=max(2, opts.powersgd_warmup),
            )
            memory = self._powersgd = PowerSGDMemory(state, model, comm.world_size)

            def inner(hook_state, bucket):  # noqa: ANN001, ANN202
                memory.align(bucket)
                return powerSGD_hook.powerSGD_hook(hook_state, bucket)

            nbytes = lambda b: _powersgd_bytes(state, b)  # noqa: E731
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

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.options.compress == "powersgd":
            state["powersgd"] = (self._powersgd.state_dict() if self._powersgd is not None
                                 else {"world_size": self.comm.world_size})
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
        if self._powersgd is not None:
            self._powersgd.load_state_dict(saved)
