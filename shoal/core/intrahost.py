"""The processes of one host summing tensors through shared memory, at memory speed.

Gloo all-reduces through TCP over loopback even between processes of one host: 0.5 ms for
LeNet-5's 83.5 KiB of gradients on a 2-core machine, where adding them takes 2.5 µs
(issue 57). :class:`SharedReducer` sums through one shared-memory segment instead.

The segment holds, twice over (calls alternate between the two halves, so a rank still
reading one call's result never races the next call's writes), one slot per rank and a
result slot. An all-reduce of a chunk is:

1. each rank copies its tensor (scaled: DDP's division by the world size) into its slot;
2. a barrier;
3. each rank sums its 1/n slice over the slots, always in rank order, into the result
   slot (a reduce-scatter: deterministic, and with 2 ranks equal bit for bit to Gloo's);
4. a barrier;
5. each rank copies the whole result back into its tensor (an all-gather).

With 2 ranks, or chunks of at most 1 MiB, steps 3-5 are one: each rank sums every slot,
in rank order, straight into its tensor. That saves a barrier, the latency that counts at
these sizes (and with 2 ranks a pass over the memory too); the sums are the same.

Tensors larger than a slot go chunk by chunk. A barrier is one counter per rank, each
written by its rank only, on a cache line of its own: no atomics are needed on x86-64,
whose stores become visible in program order (so the fast path is offered there only).
A waiting rank spins for a few microseconds, then yields its core, then sleeps on a futex
its peer wakes: with as many processes as cores, spinning would take the core a peer's
compute needs.

The segment lives in ``/dev/shm`` only while the ranks map it: rank 0 creates it (owner
only, under a random name), every rank maps it, and rank 0 unlinks it as soon as all have
(or failed to), so a crash later leaves nothing behind; the memory goes with the last
mapping. Segments that a creator killed inside that window left are removed by the next
job's rank 0 (:mod:`shoal.core.segment`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import time
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist

from shoal.core import futex
from shoal.errors import JobError

_LINE = 64  # bytes: a cache line, so that no two ranks' counters share one
#: The default slot: a chunk of at most this many bytes is summed at a time.
SLOT_BYTES = 4 << 20
_MASK = 0xFFFFFFFF
#: Chunks up to this many bytes are summed by every rank whole (one barrier); larger ones
#: among 3 ranks or more, each rank its slice (less memory traffic, one barrier more).
_DIRECT_BYTES = 1 << 20


class PeerEnded(JobError):
    """A rank of the host ended while this one waited for it inside a sum: the echo of that
    rank's failure, which a launcher reports as the cause."""

    echo = True


def segment_bytes(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    """The size of the segment of ``world_size`` ranks: counters, then two halves of
    ``world_size`` slots and a result slot each."""
    return _LINE * world_size + 2 * (world_size + 1) * slot_bytes


class _Views(NamedTuple):
    """One half's slots for one size: this rank's, every rank's, the result, and this rank's
    part of every rank's slot and of the result."""

    mine: torch.Tensor
    slots: list[torch.Tensor]
    result: torch.Tensor
    parts: list[torch.Tensor]
    part: torch.Tensor


class SharedReducer:
    """In-place sums of tensors among the ``world_size`` ranks that map one segment
    (:func:`create_segment`, :func:`open_segment`), this one ``rank``. The segment's memory
    goes with the last rank's mapping (the process's end).

    Every rank must call :meth:`all_reduce` with tensors of the same size and dtype, in the
    same order. A wait for a rank whose process ended (``pids``: each rank's process, where
    known) or longer than ``timeout`` seconds raises :class:`~shoal.errors.JobError`.
    """

    def __init__(self, segment: mmap.mmap, rank: int, world_size: int, *,
                 slot_bytes: int = SLOT_BYTES, timeout: float = 300.0,
                 pids: list[int] | None = None) -> None:
        if slot_bytes <= 0 or slot_bytes % _LINE:
            raise ValueError(f"a slot is a positive multiple of {_LINE} bytes, not {slot_bytes}")
        if len(segment) != segment_bytes(world_size, slot_bytes):
            raise ValueError(f"segment of {len(segment)} bytes, not the "
                             f"{segment_bytes(world_size, slot_bytes)} {world_size} ranks need")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.slot_bytes = slot_bytes
        #: Chunks of at most this many bytes are summed whole by every rank (one barrier).
        self.direct_bytes = _DIRECT_BYTES
        self._segment = segment
        raw = np.frombuffer(segment, dtype=np.uint8)
        self._counters = np.ndarray((world_size,), dtype=np.uint32, buffer=segment,
                                    strides=(_LINE,))
        self._addresses = [raw.ctypes.data + _LINE * r for r in range(world_size)]
        self._data = torch.from_numpy(raw[_LINE * world_size:])
        self._epoch = int(self._counters[rank])  # barriers passed, mod 2**32 (0 when fresh)
        self._half = 0
        self._cache: dict[tuple[int, torch.dtype, int], _Views] = {}
        self._others = [r for r in range(world_size) if r != rank]
        self._gone: dict[int, int] = {}  # rank -> a pidfd of its process (readable once ended)
        for other in self._others if pids is not None else ():
            with contextlib.suppress(OSError):  # already ended: its first wait says so
                self._gone[other] = os.pidfd_open(pids[other])
                weakref.finalize(self, os.close, self._gone[other])

    def within_host(self) -> SharedReducer:
        """This reducer: its ranks share one host."""
        return self

    def _views(self, dtype: torch.dtype, numel: int) -> _Views:
        """The current half's slots as ``numel`` elements of ``dtype`` (made once per size:
        slicing a tensor costs more than copying LeNet-5's gradients)."""
        key = (self._half, dtype, numel)
        views = self._cache.get(key)
        if views is None:
            views = self._cache[key] = self._make_views(dtype, numel)
        return views

    def _make_views(self, dtype: torch.dtype, numel: int) -> _Views:
        n, size = self.world_size, self.slot_bytes
        start = self._half * (n + 1) * size
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        slots = [self._data[start + i * size:start + i * size + nbytes].view(dtype)
                 for i in range(n + 1)]
        lo, hi = _share(numel, n, self.rank)
        return _Views(slots[self.rank], slots[:n], slots[n], [s[lo:hi] for s in slots[:n]],
                      slots[n][lo:hi])

    def all_reduce(self, tensor: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place, in rank order.

        Args:
            tensor: A contiguous CPU tensor, of the same size and dtype on every rank.
            scale: Multiply each rank's values by it first (DDP's ``1 / world_size``).

        Returns:
            ``tensor``, holding the sum.

        Raises:
            JobError: A rank did not come within the timeout.
        """
        flat = tensor.view(-1)
        per_chunk = self.slot_bytes // flat.element_size()
        if flat.numel() <= per_chunk:
            self._reduce_chunk(flat, scale)
            return tensor
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start:start + per_chunk], scale)
        return tensor

    def _reduce_chunk(self, chunk: torch.Tensor, scale: float | None) -> None:
        views = self._views(chunk.dtype, chunk.numel())
        self._half ^= 1
        if scale is None:
            views.mine.copy_(chunk)
        else:
            torch.mul(chunk, scale, out=views.mine)
        self._barrier()
        if self.world_size == 2 or chunk.numel() * chunk.element_size() <= self.direct_bytes:
            # Each rank sums every slot itself: one barrier, not two, and with 2 ranks
            # less memory traffic too (the reduce-scatter's result slot is one more pass).
            torch.add(views.slots[0], views.slots[1], out=chunk)
            for slot in views.slots[2:]:
                chunk.add_(slot)
            return
        parts, out = views.parts, views.part
        if out.numel():
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)
        self._barrier()
        chunk.copy_(views.result)

    # -- copies: a broadcast, a gather, a scatter (any dtype: bytes are moved, not added) ----
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``src``'s, in place (a contiguous CPU tensor of the
        same size and dtype on every rank); returns it."""
        flat = _bytes(tensor)
        for part, slots in self._rounds(flat.numel()):
            if self.rank == src:
                slots[self.world_size].copy_(flat[part])
            self._barrier()
            if self.rank != src:
                flat[part].copy_(slots[self.world_size])
        return tensor

    def all_gather(self, tensor: torch.Tensor, out: list[torch.Tensor] | None) -> None:
        """Every rank's ``tensor`` (contiguous, CPU, alike on every rank) into ``out``, one
        tensor like it per rank in rank order; ``None``: not to this rank (a gather's other
        ranks, which only send)."""
        flat = _bytes(tensor)
        outs = None if out is None else [_bytes(o) for o in out]
        for part, slots in self._rounds(flat.numel()):
            slots[self.rank].copy_(flat[part])
            self._barrier()
            for slot, o in zip(slots, outs or (), strict=False):
                o[part].copy_(slot)

    def scatter(self, shares: list[torch.Tensor] | None, out: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``shares`` (one per rank, each like ``out``) to the ranks: each
        rank's into its ``out`` (``shares`` is read on ``src`` only)."""
        flat = _bytes(out)
        parts = None if shares is None or self.rank != src else [_bytes(s) for s in shares]
        for part, slots in self._rounds(flat.numel()):
            for slot, share in zip(slots, parts or (), strict=False):
                slot.copy_(share[part])
            self._barrier()
            flat[part].copy_(slots[self.rank])

    def _rounds(self, nbytes: int) -> Iterator[tuple[slice, list[torch.Tensor]]]:
        """A copy of ``nbytes`` bytes, a slot's worth a round: each round's byte range, and
        the slots (every rank's, then the result slot) of the half it uses, as bytes; the
        next round or call uses the other half."""
        size = self.slot_bytes
        for start in range(0, nbytes, size):
            n = min(size, nbytes - start)
            base = self._half * (self.world_size + 1) * size
            self._half ^= 1
            yield slice(start, start + n), [self._data[base + i * size:base + i * size + n]
                                            for i in range(self.world_size + 1)]

    def _barrier(self) -> None:
        """Wait until every rank has reached this barrier. A rank waiting at barrier ``e``
        sees another's counter at ``e - 1`` (not come yet), ``e`` or ``e + 1`` (come, and
        gone on to the next): "not ``e - 1``" is its arrival, whatever the 32-bit
        counters have wrapped to."""
        self._epoch = (self._epoch + 1) & _MASK
        counters, before = self._counters, (self._epoch - 1) & _MASK
        counters[self.rank] = self._epoch
        futex.wake(self._addresses[self.rank])
        for other in self._others:
            if counters[other] == before:
                self._wait(other, before)

    def _wait(self, other: int, before: int) -> None:
        """Wait (:func:`shoal.core.futex.wait_while`: spin, yield, then sleep on the counter's
        word, woken by its writer) until rank ``other``'s counter leaves ``before``."""
        counters = self._counters

        def check(now: float) -> None:
            fd = self._gone.get(other)
            if fd is not None and select.select([fd], [], [], 0)[0]:
                raise PeerEnded(f"rank {other}'s process ended inside the shared-memory "
                                f"all-reduce (rank {self.rank} of {self.world_size})")
            if now >= deadline:
                raise JobError(f"rank {other} did not reach the shared-memory all-reduce "
                               f"within {self.timeout:g} s (rank {self.rank} of "
                               f"{self.world_size})")

        deadline = time.perf_counter() + self.timeout
        futex.wait_while(lambda: counters[other] == before, self._addresses[other], before,
                         deadline, check)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's memory as a flat uint8 tensor (a view)."""
    if not tensor.is_contiguous():
        raise ValueError("the host's memory moves contiguous tensors only")
    return tensor.reshape(-1).view(torch.uint8)


def _share(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s slice ``[lo, hi)`` of ``numel`` elements cut in ``world_size``."""
    base, extra = divmod(numel, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


#: What the host's memory sums: what adds without surprise (no bool, no complex).
_SUMMED = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


class Summing(Protocol):
    """What sums a tensor among a job's processes in place (:class:`SharedReducer`,
    :class:`HostsReducer`)."""

    world_size: int

    def all_reduce(self, tensor: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (each rank's values times ``scale``)."""
        ...

    def within_host(self) -> SharedReducer | None:
        """The reducer of this process's host (``None``: alone on it)."""
        ...


class HostsReducer:
    """Sums among the processes of several hosts: inside each host through its shared
    memory (``local``), across hosts among one leader a host (``leaders``: this rank's
    Gloo group if it leads its host, else ``None``), then inside the host again: the
    leader's total, to which the others add zeros (exact); a host of one process has no
    ``local``. The slow link carries one process's bytes a host. The sum's order is fixed:
    host by host, each in rank order.
    """

    def __init__(self, local: SharedReducer | None, leaders: Any, world_size: int) -> None:
        self.local, self.leaders, self.world_size = local, leaders, world_size  # local: None alone

    def within_host(self) -> SharedReducer | None:
        """The reducer of this process's host (``None``: alone on it)."""
        return self.local

    def all_reduce(self, tensor: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Sum ``tensor`` over every rank of every host, in place.

        Args:
            tensor: A contiguous CPU tensor, of the same size and dtype on every rank.
            scale: Multiply each rank's values by it first.

        Returns:
            ``tensor``, holding the sum.
        """
        if self.local is None:  # alone on its host: its leader
            if scale is not None:
                tensor.mul_(scale)
            dist.all_reduce(tensor, group=self.leaders)
            return tensor
        self.local.all_reduce(tensor, scale)
        if self.leaders is not None:
            dist.all_reduce(tensor, group=self.leaders)
        else:
            tensor.zero_()
        return self.local.all_reduce(tensor)


class HostPath:
    """A Comm's sums through the host's shared memory (its ``host``, put there by
    :func:`shoal.core.hostpath.use_host_memory`)."""

    def __init__(self, reducer: Summing) -> None:
        self.reducer = reducer

    @staticmethod
    def takes(tensor: torch.Tensor, op: str) -> bool:
        """Whether the host's memory sums ``tensor`` for ``op`` (else Gloo does)."""
        return op in ("sum", "avg") and tensor.device.type == "cpu" and \
            tensor.dtype in _SUMMED and tensor.is_contiguous()

    def one_host(self) -> SharedReducer | None:
        """The reducer of this host where every rank of the job is on it (its copies then
        serve broadcasts, gathers and scatters too), else ``None``."""
        local = self.reducer.within_host()
        return local if local is not None and local.world_size == self.reducer.world_size \
            else None

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Sum ``tensor`` in place, in rank order (``avg`` then divides by the number of
        ranks, as Gloo's path does): done when it returns."""
        self.reducer.all_reduce(tensor)
        return tensor.div_(self.reducer.world_size) if op == "avg" else tensor
