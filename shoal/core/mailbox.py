"""Messages between two processes of one host through a shared-memory segment: the
parameter server's pairs where server and client share a host (:mod:`shoal.core.pairs`).

Gloo sends between two processes of one host through TCP over loopback (issue 57: a
round trip 3-8x slower than MPI's shared memory). A pair's segment holds two byte rings,
one each way. A ring has a write count and a read count, each on a cache line of its own
and written by one side only: no atomics are needed on x86-64, whose stores become
visible in program order (the fast path is offered there only). A side that finds its
ring empty (or full) waits as :mod:`shoal.core.futex` does, woken by the other side.

A message is a frame (its tag and its length, 16 bytes) and its bytes, padded to 16: every
frame starts 16-aligned. A message that fits the ring lies whole in it (where it would
wrap, a padding frame first skips to the ring's start); one larger streams through it.
So the server's rule can read a worker's vector where it lies and write its reply where
the client will read it (:meth:`SharedLink.take`, :meth:`SharedLink.reserve`): one copy on
the server instead of three. Each tag's messages are taken in the order they were sent: a
message of a tag nobody waits for yet is kept aside until a receive of that tag comes (the
server posts the receive of a worker's next vector before its header arrives). A send is
done once its bytes are in the ring, not once the peer took them.

**A peer gone.** Each side marks its end closed when it leaves, and watches the other's
process (a pidfd): a wait for a peer that closed its end, or whose process ended (however:
``kill -9`` too), fails within milliseconds; one for a peer that is alive but silent, at
the wait's deadline. Bytes a peer sent before it went are still taken.
"""

from __future__ import annotations

import collections
import mmap
import os
import select
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from shoal.core import futex

_LINE = 64
#: A ring's bytes, each way, at most: a message larger than this streams through it.
RING_BYTES = 4 << 20
#: The least ring: a header and a small vector pass whole.
MIN_RING_BYTES = 64 << 10
#: A ring's size is a multiple of this (a cache line).
ALIGN_RING = _LINE
#: Counters, each on a cache line: ring 0's write and read counts, ring 1's, then the
#: server's and the client's "closed" flags, then for each count whether its reader sleeps
#: in the kernel (its writer makes the wake-up's system call only then).
_HEAD = 10 * _LINE
_ASLEEP = 6
#: Sends larger than this are followed by a full memory barrier before their count is
#: stored: large copies may use non-temporal stores, which x86-64 does not keep in order.
_FENCE_BYTES = 256 << 10
#: Frames start at multiples of this (bodies are padded to it): a frame never wraps, and a
#: body in place is aligned for every dtype.
_ALIGN = 16
#: The tag of a padding frame: its length is the bytes to skip, up to the ring's end.
_PAD = -1
#: A frame longer than this is malformed (a peer's bug), not a message to allocate.
_MAX_MESSAGE = 1 << 40


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def segment_bytes(ring: int = RING_BYTES) -> int:
    """The size of a pair's segment with rings of ``ring`` bytes."""
    return _HEAD + 2 * ring


class PeerGone(Exception):
    """The peer closed its end or its process ended, or it sent nothing before the
    deadline; the message is the reason, as :mod:`shoal.core.pairs` words it."""


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a flat uint8 array (a view, no copy: numpy's
    slices and copies cost a tenth of torch's at a header's size)."""
    if not tensor.is_contiguous():
        raise ValueError("a message's tensor must be contiguous")
    t = tensor.detach() if tensor.requires_grad else tensor
    try:
        array = t.numpy()
    except TypeError:  # a dtype numpy lacks (bfloat16): its bytes through torch first
        array = t.reshape(-1).view(torch.uint8).numpy()
    return array.reshape(-1).view(np.uint8)


class SharedLink:
    """One end of a pair's two rings in ``segment`` (:func:`segment_bytes` of ``ring``
    bytes): the server's end (``is_server``) writes ring 0 and reads ring 1, the client's
    the other way. ``peer_pid``: the other end's process; ``peer``: how messages name it.
    One thread at a time sends, and one receives."""

    def __init__(self, segment: mmap.mmap, is_server: bool, peer_pid: int, peer: str,
                 ring: int = RING_BYTES) -> None:
        if len(segment) != segment_bytes(ring):
            raise ValueError(f"segment of {len(segment)} bytes, not {segment_bytes(ring)}")
        raw = np.frombuffer(segment, dtype=np.uint8)
        self._counts = np.ndarray((10,), dtype=np.uint64, buffer=segment, strides=(_LINE,))
        self._addr = [raw.ctypes.data + _LINE * i for i in range(10)]
        data = raw[_HEAD:]
        out, into = (0, 1) if is_server else (1, 0)
        self._out, self._in = data[out * ring:(out + 1) * ring], data[into * ring:(into + 1) * ring]
        self._w, self._r = 2 * out, 2 * into  # counters: my ring's write, the peer's ring's
        self._mine, self._theirs = (4, 5) if is_server else (5, 4)
        self.ring, self.peer = ring, peer
        self._sent, self._taken = int(self._counts[self._w]), int(self._counts[self._r + 1])
        self._kept: dict[int, collections.deque[np.ndarray]] = collections.defaultdict(
            collections.deque)
        self._frame = np.zeros(2, dtype=np.int64)  # a message's tag and length
        self._frame_bytes = self._frame.view(np.uint8)
        self._pidfd = os.pidfd_open(peer_pid)
        weakref.finalize(self, os.close, self._pidfd)
        self._held = 0  # bytes of a message :meth:`take` left in place
        self._reserved = 0  # bytes of the messages :meth:`reserve` made room for
        self._segment = segment

    # -- sending ----------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor], tags: Sequence[int], deadline: float,
             timeout: float) -> None:
        """Put each of ``tensors`` in the ring as one message of its tag; waits for room
        (until ``deadline``, a ``time.perf_counter()`` time) where the ring is full."""
        if self._counts[self._theirs]:  # closed (a process gone is seen by the next wait)
            self._check_peer(time.perf_counter(), deadline, timeout)
        nbytes = 0
        for tensor, tag in zip(tensors, tags, strict=True):
            body = as_bytes(tensor)
            n = body.size
            if self._whole(n) and self._sent % self.ring + _ALIGN + _padded(n) > self.ring:
                pad = self.ring - self._sent % self.ring - _ALIGN  # to the ring's start
                self._write(self._framed(_PAD, pad), _ALIGN, deadline, timeout)
                self._write(None, pad, deadline, timeout)
            self._write(self._framed(tag, n), _ALIGN, deadline, timeout)
            self._write(body, n, deadline, timeout)
            self._write(None, _padded(n) - n, deadline, timeout)
            nbytes += n
        self._publish(nbytes)

    def reserve(self, tags: Sequence[int], sizes: Sequence[int], deadline: float,
                timeout: float) -> list[np.ndarray] | None:
        """Room for messages of ``sizes`` bytes (of ``tags``), each whole, to be filled
        where they lie: a writable view of each, or ``None`` where they do not fit the ring
        at once (then :meth:`send` them). They reach the peer at :meth:`commit`, in order;
        nothing else is sent meanwhile. Waits for room until ``deadline``."""
        ring, frames, need = self.ring, [], 0
        for tag, n in zip(tags, sizes, strict=True):
            at = (self._sent + need) % ring
            if at + _ALIGN + _padded(n) > ring:
                frames.append((at, _PAD, ring - at - _ALIGN))
                need, at = need + ring - at, 0
            frames.append((at, tag, n))
            need += _ALIGN + _padded(n)
        if need > ring:
            return None
        while ring - (self._sent - (taken := int(self._counts[self._w + 1]))) < need:
            self._wait(self._w + 1, taken, deadline, timeout)
        views = []
        for at, tag, n in frames:
            self._out[at:at + _ALIGN] = self._framed(tag, n)
            if tag != _PAD:
                views.append(self._out[at + _ALIGN:at + _ALIGN + n])
        self._sent += need
        self._reserved += sum(sizes)
        return views

    def commit(self) -> None:
        """Send what :meth:`reserve` made room for (filled by now)."""
        self._publish(self._reserved)
        self._reserved = 0

    def _whole(self, n: int) -> bool:
        """Whether a message of ``n`` bytes lies whole in the ring (else it streams)."""
        return _ALIGN + _padded(n) <= self.ring

    def _framed(self, tag: int, n: int) -> np.ndarray:
        self._frame[0], self._frame[1] = tag, n
        return self._frame_bytes

    def _publish(self, nbytes: int) -> None:
        """Make the bytes written so far the peer's to read, and wake it."""
        if nbytes > _FENCE_BYTES:
            futex.wake(self._addr[self._mine])  # a barrier: the bytes before their count
        self._counts[self._w] = self._sent
        self._wake(self._w)

    def _write(self, src: np.ndarray | None, n: int, deadline: float, timeout: float) -> None:
        """Put ``n`` bytes of ``src`` (``None``: padding, left as it is) in the ring."""
        done, ring = 0, self.ring
        while done < n:
            taken = int(self._counts[self._w + 1])
            room = ring - (self._sent - taken)
            if room == 0:
                self._counts[self._w] = self._sent  # what is written so far, then wait
                self._wake(self._w)
                self._wait(self._w + 1, taken, deadline, timeout)
                continue
            k, at = min(room, n - done), self._sent % ring
            if src is not None:
                first = min(k, ring - at)
                self._out[at:at + first] = src[done:done + first]
                if k > first:
                    self._out[:k - first] = src[done + first:done + k]
            done, self._sent = done + k, self._sent + k

    # -- receiving --------------------------------------------------------------------------
    def recv(self, tensors: Sequence[torch.Tensor], tags: Sequence[int], deadline: float,
             timeout: float) -> None:
        """Fill each of ``tensors`` with the next message of its tag (a message of another
        tag met meanwhile is kept for its receive); waits until ``deadline``."""
        self.release()
        for tensor, tag in zip(tensors, tags, strict=True):
            self._recv_into(as_bytes(tensor), tag, deadline, timeout)
        self._wake(self._r + 1)  # a writer waiting for room

    def take(self, tag: int, fallback: np.ndarray, deadline: float,
             timeout: float) -> np.ndarray:
        """The next message of ``tag``, of ``fallback.size`` bytes, where it lies in the
        ring (no copy) if it lies there whole, else copied into ``fallback``. A message in
        place stays as it is until :meth:`release` or the next receive."""
        self.release()
        if self._kept.get(tag):
            self._recv_into(fallback, tag, deadline, timeout)
            return fallback
        n = self._next_frame(tag, deadline, timeout)
        self._fits(n, fallback.size, tag)
        if not self._whole(n):
            self._read_body(fallback, n, deadline, timeout)
            return fallback
        while (sent := int(self._counts[self._r])) < self._taken + _padded(n):
            self._wait(self._r, sent, deadline, timeout)
        at, self._held = self._taken % self.ring, _padded(n)
        return self._in[at:at + n]

    def release(self) -> None:
        """Give the peer back the room of the message :meth:`take` left in place."""
        if self._held:
            self._taken, self._held = self._taken + self._held, 0
            self._counts[self._r + 1] = self._taken
            self._wake(self._r + 1)

    def _recv_into(self, body: np.ndarray, tag: int, deadline: float, timeout: float) -> None:
        kept = self._kept.get(tag)
        if kept:
            self._fits(kept[0].size, body.size, tag)
            body[:] = kept.popleft()
            return
        n = self._next_frame(tag, deadline, timeout)
        self._fits(n, body.size, tag)
        self._read_body(body, n, deadline, timeout)

    def _next_frame(self, tag: int, deadline: float, timeout: float) -> int:
        """Read frames up to the next message of ``tag`` and return its length: padding is
        skipped, a message of another tag kept aside for its receive."""
        while True:
            self._read(self._frame_bytes, _ALIGN, deadline, timeout)
            got, n = int(self._frame[0]), int(self._frame[1])
            if not 0 <= n < _MAX_MESSAGE or (got == _PAD and n > self.ring):
                raise PeerGone(f"{self.peer} sent a malformed frame (tag {got}, {n} bytes)")
            if got == tag:
                return n
            if got == _PAD:
                self._read(None, n, deadline, timeout)
                continue
            aside = np.empty(n, dtype=np.uint8)
            self._read_body(aside, n, deadline, timeout)
            self._kept[got].append(aside)

    def _fits(self, got: int, want: int, tag: int) -> None:
        if got != want:
            raise PeerGone(f"{self.peer} sent a message of {got} bytes on tag {tag} where "
                           f"{want} were expected")

    def _read_body(self, dst: np.ndarray, n: int, deadline: float, timeout: float) -> None:
        """A message's ``n`` bytes into ``dst``, and past the padding after them."""
        self._read(dst, n, deadline, timeout)
        self._read(None, _padded(n) - n, deadline, timeout)

    def _read(self, dst: np.ndarray | None, n: int, deadline: float, timeout: float) -> None:
        """Take ``n`` bytes from the ring into ``dst`` (``None``: skip them)."""
        done, ring = 0, self.ring
        while done < n:
            sent = int(self._counts[self._r])
            ready = sent - self._taken
            if ready == 0:
                self._wake(self._r + 1)  # room made so far, then wait
                self._wait(self._r, sent, deadline, timeout)
                continue
            k, at = min(ready, n - done), self._taken % ring
            if dst is not None:
                first = min(k, ring - at)
                dst[done:done + first] = self._in[at:at + first]
                if k > first:
                    dst[done + first:done + k] = self._in[:k - first]
            done, self._taken = done + k, self._taken + k
            self._counts[self._r + 1] = self._taken

    # -- waiting and failures ---------------------------------------------------------------
    def _wait(self, counter: int, before: int, deadline: float, timeout: float) -> None:
        """Until ``counter`` leaves ``before`` (the value that made this side wait)."""
        counts = self._counts
        futex.wait_while(lambda: int(counts[counter]) == before, self._addr[counter], before,
                         deadline, lambda now: self._check_peer(now, deadline, timeout),
                         nap=0.005, asleep=lambda on: counts.__setitem__(_ASLEEP + counter, on))

    def _wake(self, counter: int) -> None:
        """Wake the reader of ``counter`` if it sleeps in the kernel (one spinning or
        yielding sees the count itself). Its flag is raised before the kernel reads the
        count and this side reads the flag after storing the count, microseconds apart: a
        reader that slept on an old count all the same wakes at its nap (5 ms)."""
        if self._counts[_ASLEEP + counter]:
            futex.wake(self._addr[counter])

    def _check_peer(self, now: float, deadline: float, timeout: float) -> None:
        if self._counts[self._mine]:  # closed here, by another thread: its waits end too
            raise PeerGone("closed")
        if self._counts[self._theirs] or select.select([self._pidfd], [], [], 0)[0]:
            raise PeerGone(f"{self.peer} closed the connection (killed, crashed or exited)")
        if now >= deadline:
            raise PeerGone(f"{self.peer} sent nothing for {timeout:g} s (hung, stopped or "
                           "too slow)")

    def close(self) -> None:
        """Mark this end closed: the peer's waits fail at once. (The peer's pidfd is closed
        with this object, the segment's memory with the last mapping.)"""
        self._counts[self._mine] = 1
        futex.wake(self._addr[self._w])
        futex.wake(self._addr[self._r + 1])
