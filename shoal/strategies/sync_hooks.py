"""The DDP communication hooks of ``sync --compress``, their collectives through
:class:`~shoal.core.comm.Comm` so that what they send is counted like every strategy's.

- fp16 and bf16 (:func:`compress_hook`): PyTorch's ``fp16_compress_hook`` and
  ``bf16_compress_hook`` (cast, divide by the world size, all-reduce, cast back into the
  bucket), with the all-reduce issued by :meth:`Comm.all_reduce_future`; the same hook
  without the cast for an elastic run's plain all-reduce;
- ``--intra-host`` (:func:`shared_memory_hook`): the sum through the host's shared memory
  (:mod:`shoal.core.intrahost`), done inside the hook, DDP's division folded into its first
  copy;
- PowerSGD (:func:`powersgd_hook`): PyTorch's own hook, which issues its several
  all-reduces itself (under ``--elastic`` their chain is waited on as one collective,
  :meth:`Comm.watch_future`); :func:`powersgd_bytes` counts what they send. Its state is kept per
  parameter (:class:`PowerSGDMemory`), so checkpoints carry it and a resumed run is exact.

No hook books time: DDP runs them inside backward; ``sync`` books the all-reduce that
backward did not hide once backward returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from shoal.core.comm import Comm
from shoal.core.intrahost import Summing
from shoal.core.waits import describe
from shoal.errors import ShoalError

#: A DDP communication hook: (state, bucket) -> future of the reduced bucket.
Hook = Callable[[Any, Any], torch.futures.Future]


def compress_hook(comm: Comm, dtype: torch.dtype | None) -> Hook:
    """A hook that all-reduces each bucket cast to ``dtype`` (float16 or bfloat16; ``None``:
    as it is, for an elastic run, whose wait in the hook is left as soon as another worker
    says the step's meeting failed: DDP's own all-reduce would wait out its timeout)."""

    # No annotations: DDP checks them at run time against the real classes.
    def hook(state, bucket):  # noqa: ANN001, ANN202
        buffer = bucket.buffer()
        sent = (buffer if dtype is None else buffer.to(dtype)).div_(comm.world_size)

        def decompress(fut):  # noqa: ANN001, ANN202
            # Into the bucket itself, not a new tensor: the peak memory stays one bucket.
            return buffer if dtype is None else buffer.copy_(fut.value()[0])

        return comm.all_reduce_future(sent).then(decompress)

    return hook


def shared_memory_hook(comm: Comm, reducer: Summing) -> Hook:
    """A hook that averages each bucket through the host's shared memory, at once: the
    returned future is done. Each rank's share is ``1 / world_size`` of its gradients (as
    DDP's own path scales them), summed in rank order."""
    scale = 1.0 / comm.world_size
    what = describe("all_reduce", "gradients")  # as Gloo's path names it

    def hook(state, bucket):  # noqa: ANN001, ANN202
        buffer = bucket.buffer()
        comm.count(buffer.numel() * buffer.element_size())
        with comm.log.track(what):
            reducer.all_reduce(buffer, scale)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done

    return hook


def powersgd_hook(comm: Comm, model: nn.Module, rank: int, warmup: int
                  ) -> tuple[powerSGD_hook.PowerSGDState, Hook, PowerSGDMemory]:
    """PowerSGD of matrix rank ``rank`` after ``warmup`` plain steps: the hook's state, the
    hook, and the memory that lays the state out per parameter (for checkpoints)."""
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        # With error feedback the hook needs 2 plain steps at least (DDP rebuilds its
        # buckets after the first).
        start_powerSGD_iter=max(2, warmup),
    )
    memory = PowerSGDMemory(state, model, comm.world_size)

    def hook(hook_state, bucket):  # noqa: ANN001, ANN202
        memory.align(bucket)
        comm.count(powersgd_bytes(state, bucket))
        # --elastic: left as soon as the step's meeting fails, as the plain hook's is
        return comm.watch_future(powerSGD_hook.powerSGD_hook(hook_state, bucket))

    return state, hook, memory



def powersgd_bytes(state: powerSGD_hook.PowerSGDState, bucket: Any) -> int:
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
