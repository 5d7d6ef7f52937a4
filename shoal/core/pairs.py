"""The parameter server's transport: pairs of a server and a client, and their failures.

An asynchronous job's servers and clients talk over one pair each (:class:`PairChannel`, in
the store prefix ``ps/{server}/{client}``: server = pair rank 0, client = pair rank 1), so a
dead client breaks only its own pair. Where both ends share a host, a pair's messages go
through a shared-memory segment of its own (:mod:`shoal.core.mailbox`, with the same tags,
order and failures as below); else through a two-rank ``ProcessGroupGloo``'s point-to-point
``send``/``recv``. Not through ``torch.distributed.rpc``. What a server does with
the messages is :mod:`shoal.ps`'s; this module knows no server rule and no strategy.
The messages themselves (a header, then a vector or pickled bytes, by tag) are
:mod:`shoal.core.header`'s.

**Dead and hung peers.** Gloo fails a pending ``send``/``recv`` as soon as the connection is
reset, so a peer killed with ``kill -9`` is detected within milliseconds. A peer that is
alive but silent (stopped, hung, or computing longer than ``timeout``) is detected when the
wait's ``timeout`` expires. Either way the pair is broken for good (Gloo closes a pair whose
operation timed out) and every later use raises :class:`ChannelError`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from shoal.core.header import (
    HEADER_SIZE,
    TAG_BYTES,
    TAG_HEAD,
    Header,
    Kind,
    check_field_names,
    from_bytes,
    to_bytes,
)
from shoal.core.linkoffer import offer_link, take_link
from shoal.core.mailbox import RING_BYTES, PeerGone, SharedLink, as_bytes
from shoal.core.stop import stop_requested
from shoal.errors import ShoalError

_FIELDS_KEY = "shoal_rule_fields"  # where a pair's server sets its rule's field names


_T = TypeVar("_T")


def _over(view: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s dtype and shape over the bytes ``view`` (no copy)."""
    t = torch.from_numpy(view).view(like.dtype)
    return t if like.dim() == 1 else t.view(like.shape)


class ChannelError(ShoalError):
    """The peer of a pair is gone (connection closed: killed, crashed, exited) or was silent
    past the timeout. The message names the pair and the reason, on one line."""

    #: The echo of another process's failure: a launcher reports that one as the cause.
    echo = True


class Client(Protocol):
    """A worker's end of the parameter servers, as its :class:`~shoal.core.comm.Comm` holds
    it (``comm.ps``): :class:`shoal.ps.client.ServerClient` in a job, a test's in-process
    double. Its exchanges are booked on that Comm (time as communication, payload bytes)."""

    versions: list[int]  #: the last version seen of each server
    timeout: float  #: seconds any wait for a server may take

    def exchange(self, payload: torch.Tensor, reply: torch.Tensor, header: Header) -> None:
        """Send every server its slice of ``payload``; receive each reply into ``reply``."""

    def pull(self, reply: torch.Tensor, header: Header | None = None) -> None:
        """Receive every server's shard into its slice of ``reply``."""

    def report(self, obj: Any, header: Header | None = None,
               timeout: float | None = None) -> None:
        """Send ``obj`` to server 0's coordinator; returns once it was handled."""

    def close(self) -> None:
        """Leave the servers cleanly (done, not lost); never raises."""

    def abandon(self) -> None:
        """Leave the servers without a word, after a failure reported; never raises."""


def _reason(exc: BaseException, peer: str, timeout: float) -> str:
    text = str(exc)
    if "Timed out" in text or "timed out" in text or "wait timeout" in text:
        return f"{peer} sent nothing for {timeout:g} s (hung, stopped or too slow)"
    if "closed by peer" in text or "Connection reset" in text or "closure" in text \
            or "Broken pipe" in text or "EPIPE" in text:
        return f"{peer} closed the connection (killed, crashed or exited)"
    first = (text.strip().splitlines() or [type(exc).__name__])[0]
    return f"{peer}: {first[:200]}"


class Pending:
    """Gloo works posted on one channel, finished by :meth:`PairChannel.finish`."""

    __slots__ = ("works", "what")

    def __init__(self, works: list[Any], what: str) -> None:
        self.works, self.what = works, what


class PairChannel:
    """Two-rank Gloo group between server ``server`` (pair rank 0) and client ``client``
    (pair rank 1), in the store prefix ``ps/{server}/{client}``.

    ``fields``: on the server's end, the names of its rule's header fields (set in the
    pair's prefix before connecting); on the client's end ``None``: read once connected.
    ``intra_host``: ``gloo``, or (``auto``, ``shm``) the host's shared memory where both ends
    share a host (:mod:`shoal.core.mailbox`), its rings sized by the server's ``message``
    (the pair's largest message, in bytes).
    Connecting waits up to ``connect_timeout`` seconds (default: ``timeout``) for the peer.
    Every send and receive is bounded by a timeout; a failure raises :class:`ChannelError`
    and breaks the channel for good. Tensors travel whole, one message each, and must be
    contiguous CPU tensors. One exchange at a time: callers that share a channel between
    threads hold :attr:`lock` around a request and its reply.
    """

    def __init__(self, store: dist.Store, server: int, client: int, timeout: float,
                 connect_timeout: float | None = None,
                 fields: Sequence[str] | None = None, intra_host: str = "auto",
                 message: int = RING_BYTES) -> None:
        self.server, self.client, self.is_server = server, client, fields is not None
        self.timeout = float(timeout)
        self.peer = f"client {client}" if self.is_server else f"server {server}"
        self.name = f"parameter-server pair (server {server}, client {client})"
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.last_sent = time.monotonic()
        self._peer_rank = 1 if self.is_server else 0
        # A store client of its own: a TCPStore client serializes its calls, and a pair
        # waiting in it for its peer must not hold up the other pairs of this process.
        with contextlib.suppress(RuntimeError, NotImplementedError):
            store = store.clone()
        prefix = dist.PrefixStore(f"ps/{server}/{client}", store)
        if fields is not None:
            prefix.set(_FIELDS_KEY, ",".join(check_field_names(fields, self.name)))
        connect = self.timeout if connect_timeout is None else float(connect_timeout)
        self._link = self._share(prefix, intra_host, connect, message)
        self._pg: Any = None if self._link is not None else self._connect(prefix, connect)
        if fields is None:
            text = prefix.get(_FIELDS_KEY).decode()
            fields = check_field_names(text.split(",") if text else (), self.name)
        self.fields: tuple[str, ...] = tuple(fields)  #: the rule's fields in every header
        self.header_size = HEADER_SIZE + len(self.fields)

    def _share(self, prefix: dist.Store, mode: str, connect: float,
               message: int) -> SharedLink | None:
        """The pair's shared-memory link where both ends share a host, or ``None``."""
        try:
            if self.is_server:
                return offer_link(prefix, mode, self.peer, connect, message)
            return take_link(prefix, mode, self.peer, connect)
        except (RuntimeError, ValueError) as exc:
            raise self._not_connected(exc, connect) from None

    def _connect(self, prefix: dist.Store, connect: float) -> Any:
        try:
            pg = dist.ProcessGroupGloo(prefix, 0 if self.is_server else 1, 2,
                                       timedelta(seconds=connect))
            pg._set_default_timeout(timedelta(seconds=self.timeout))
            return pg
        except (RuntimeError, ValueError) as exc:
            raise self._not_connected(exc, connect) from None

    def _not_connected(self, exc: BaseException, connect: float) -> ChannelError:
        text = str(exc)
        if stop_requested():  # SIGTERM while it waited: the peer stops too, or is gone
            self.broken = f"stopped by SIGTERM while connecting to {self.peer}"
        elif "timeout" in text or "Timed out" in text or "timed out" in text:
            self.broken = f"{self.peer} did not connect within {connect:g} s"
        else:
            first = (text.strip().splitlines() or [type(exc).__name__])[0][:200]
            self.broken = f"could not connect to {self.peer}: {first}"
        return ChannelError(f"{self.name}: {self.broken}")

    # -- headers ----------------------------------------------------------------------------
    def pack(self, header: Header, **base: int) -> torch.Tensor:
        """``header`` as this pair's messages carry it (with the rule's fields; the
        transport's fields in ``base`` as given there)."""
        return header.pack(self.fields, **base)

    def unpack(self, buf: torch.Tensor) -> Header:
        return Header.unpack(buf, self.fields)

    def header_buffer(self) -> torch.Tensor:
        """A tensor to receive one of this pair's headers into."""
        return torch.empty(self.header_size, dtype=torch.float64)

    # -- non-blocking halves ----------------------------------------------------------------
    def isend(self, tensors: list[torch.Tensor], tags: Sequence[int] | None = None) -> Pending:
        """Start sending each of ``tensors`` as one message (with ``tags``, default
        :data:`TAG_HEAD`); :meth:`finish` waits."""
        pending = self._post("send", tensors, tags)
        self.last_sent = time.monotonic()
        return pending

    def irecv(self, tensors: list[torch.Tensor], tags: Sequence[int] | None = None) -> Pending:
        """Start receiving the next messages of ``tags`` (default :data:`TAG_HEAD`) into
        ``tensors`` (their sizes must match the sent ones'); :meth:`finish` waits."""
        return self._post("recv", tensors, tags)

    def _post(self, what: str, tensors: list[torch.Tensor],
              tags: Sequence[int] | None) -> Pending:
        self._check()
        tags = tags or [TAG_HEAD] * len(tensors)
        if self._link is not None:  # a send is done once in the ring; a receive, when finished
            if what == "send":
                self._through_link(self.timeout, self._link.send, tensors, tags)
                return Pending([], what)
            return Pending(list(zip(tensors, tags, strict=True)), what)
        op = getattr(self._pg, what)
        try:
            works = [op([t], self._peer_rank, tag) for t, tag in zip(tensors, tags, strict=True)]
        except RuntimeError as exc:
            raise self._fail(exc, self.timeout) from None
        return Pending(works, what)

    def finish(self, pending: Pending, timeout: float | None = None) -> None:
        """Wait for ``pending`` to complete, at most ``timeout`` seconds (default: the
        channel's) in all."""
        limit = self.timeout if timeout is None else float(timeout)
        if self._link is not None:
            if pending.works:
                self._check()
                tensors, tags = zip(*pending.works, strict=True)
                self._through_link(limit, self._link.recv, tensors, tags)
            return
        deadline = time.monotonic() + limit
        for work in pending.works:
            self._check()
            left = max(deadline - time.monotonic(), 0.001)
            try:
                work.wait(timedelta(seconds=left))
            except RuntimeError as exc:
                raise self._fail(exc, limit) from None

    # -- blocking ---------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], timeout: float | None = None,
             tags: Sequence[int] | None = None) -> None:
        """Send each of ``tensors`` whole; blocks until the peer has received them (Gloo
        hands the data over when the peer's receive is posted), at most ``timeout``."""
        self.finish(self.isend(tensors, tags), timeout)

    def recv(self, tensors: list[torch.Tensor], timeout: float | None = None,
             tags: Sequence[int] | None = None) -> None:
        """Receive the next messages into ``tensors``, waiting at most ``timeout`` seconds
        (default: the channel's) in all."""
        self.finish(self.irecv(tensors, tags), timeout)

    def send_object(self, obj: Any, kind: int, header: Header | None = None,
                    timeout: float | None = None) -> None:
        """Send ``obj`` pickled: a header (``kind``, ``nbytes``) and the bytes as uint8."""
        data = to_bytes(obj)
        head = replace(header or Header(kind, self.client), kind=kind, nbytes=data.numel())
        self.send([self.pack(head), data], timeout, [TAG_HEAD, TAG_BYTES])

    def recv_answer(self, timeout: float | None = None) -> Header:
        """Receive a reply's header; an ``Kind.ERROR`` reply raises its message as a
        :class:`~shoal.errors.ShoalError` naming the server."""
        buf = self.header_buffer()
        self.recv([buf], timeout)
        return self.check_answer(self.unpack(buf))

    def check_answer(self, head: Header) -> Header:
        """``head``, unless it is an ``Kind.ERROR`` reply: then its message (which follows)
        is raised as one line naming the server."""
        if head.kind == Kind.ERROR:
            raise ShoalError(f"server {self.server}: {from_bytes(self.recv_bytes(head.nbytes))}")
        return head

    def recv_object(self, timeout: float | None = None) -> Any:
        """Receive what :meth:`send_object` sent; an ``Kind.ERROR`` header raises its message
        as a :class:`~shoal.errors.ShoalError`."""
        head = self.recv_answer(timeout)
        return from_bytes(self.recv_bytes(head.nbytes, timeout))

    def recv_bytes(self, nbytes: int, timeout: float | None = None) -> torch.Tensor:
        """Receive ``nbytes`` bytes (one message) as a uint8 tensor."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self.recv([buf], timeout, [TAG_BYTES])
        return buf

    def close(self) -> None:
        """Leave the pair (no message; the peer sees the connection close)."""
        if self.broken is None:
            self.broken = "closed"
        if self._link is not None:
            self._link.close()
        self._pg = None

    @property
    def shared(self) -> bool:
        """Whether the pair's messages go through the host's shared memory, not Gloo."""
        return self._link is not None

    def _through_link(self, limit: float, op: Callable[..., _T], *args: Any) -> _T:
        """``op(*args, deadline, limit)`` on the shared link; a peer gone breaks the pair."""
        try:
            return op(*args, time.perf_counter() + limit, limit)
        except PeerGone as exc:
            if self.broken is None:
                self.broken = str(exc)
            raise ChannelError(f"{self.name}: {self.broken}") from None

    # -- in place, where the pair shares memory ---------------------------------------------
    def take(self, tag: int, fallback: torch.Tensor) -> torch.Tensor:
        """The next message of ``tag``, of ``fallback``'s size, on a pair that shares memory
        (:attr:`shared`): where the message lies whole in the ring, a tensor like
        ``fallback`` over it in place (kept until the pair's next receive or
        :meth:`commit`); else received into ``fallback``."""
        assert self._link is not None
        self._check()
        body = as_bytes(fallback)
        got = self._through_link(self.timeout, self._link.take, tag, body)
        return fallback if got is body else _over(got, fallback)

    def reserve(self, tags: Sequence[int], like: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """On a pair that shares memory (:attr:`shared`): tensors like ``like``, lying where
        the peer will read them as the next messages of ``tags`` once filled and
        :meth:`commit` ted; ``None`` where they do not fit the ring at once."""
        assert self._link is not None
        self._check()
        views = self._through_link(self.timeout, self._link.reserve, tags,
                                   [t.numel() * t.element_size() for t in like])
        return None if views is None else [_over(v, t) for v, t in zip(views, like, strict=True)]

    def commit(self) -> None:
        """Send what :meth:`reserve` made room for, and give back the room of the message
        :meth:`take` left in place."""
        assert self._link is not None
        self._link.release()
        self._link.commit()

    # -- failures ---------------------------------------------------------------------------
    def _check(self) -> None:
        if self.broken is not None:
            raise ChannelError(f"{self.name}: {self.broken}")

    def _fail(self, exc: BaseException, timeout: float) -> ChannelError:
        if self.broken is None:
            self.broken = _reason(exc, self.peer, timeout)
        return ChannelError(f"{self.name}: {self.broken}")
