"""A worker's (or the coordinator's) end of the parameter servers: :class:`ServerClient`.

One :class:`~shoal.core.pairs.PairChannel` per server; a request goes to every server at
once, each its slice of the flat vector, and each reply lands in its slice of the reply.
A worker's exchanges and pulls are booked on its :class:`~shoal.core.comm.Comm` as every
collective is (time as communication, payload bytes sent); reports and state requests are
bookkeeping, as a synchronous run's metric reductions are, and are not booked.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.comm import Comm
from shoal.core.header import TAG_DATA, TAG_HEAD, Header, Kind
from shoal.core.pairs import ChannelError, PairChannel
from shoal.errors import ShoalError


def keepalive(timeout: float) -> float:
    """How often an idle client pings its servers: a worker of hogwild (which only reports
    at its epochs' ends) or the coordinator must not look lost after ``timeout``."""
    return min(timeout / 3, 30.0)


class ServerClient:
    """A client's end of the servers ``servers`` (default ``0 .. len(ranges)-1``), whose
    shards are ``ranges[i] = (start, end)`` of the flat vector.

    ``comm``: the worker's Comm, which books its exchanges and pulls (none: nothing is
    booked, as for the coordinator). With ``keepalive`` (seconds), a background thread sends
    a PING on every pair that has sent nothing for that long, so an idle client is not
    declared lost; it must be below ``timeout``. The client fills each request's ``kind``,
    ``client`` and (per server) ``version``; the rest of the header is the caller's. A reply
    to an exchange may be held back by the server's admission for up to ``timeout``, so an
    exchange waits up to twice ``timeout`` for it. Connecting waits up to
    ``connect_timeout`` (default: ``timeout``) for each server, all at once.
    """

    def __init__(self, store: dist.Store, client: int, ranges: list[tuple[int, int]], *,
                 timeout: float, servers: list[int] | None = None, comm: Comm | None = None,
                 keepalive: float | None = None, connect_timeout: float | None = None,
                 intra_host: str = "auto") -> None:
        servers = list(range(len(ranges))) if servers is None else list(servers)
        if len(servers) != len(ranges):
            raise ShoalError(f"client {client}: {len(ranges)} shard ranges for "
                             f"{len(servers)} servers")
        if keepalive is not None and not 0 < keepalive < timeout:
            raise ShoalError(f"keepalive must be between 0 and the timeout ({timeout:g} s), "
                             f"got {keepalive}")
        self.client, self.ranges, self.servers = client, [tuple(r) for r in ranges], servers
        self.timeout, self.comm, self.intra_host = float(timeout), comm, intra_host
        self.connect_timeout = self.timeout if connect_timeout is None else float(connect_timeout)
        self.versions = [0] * len(servers)  #: last version seen per server
        self._channels = self._connect(store)
        self._hin = [ch.header_buffer() for ch in self._channels]
        self._closed = False
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        if keepalive is not None:
            self._keeper = threading.Thread(target=self._keep_alive, args=(keepalive,),
                                            daemon=True, name=f"shoal-ps-keepalive{client}")
            self._keeper.start()

    def _connect(self, store: dist.Store) -> list[PairChannel]:
        results: list[PairChannel | ChannelError | None] = [None] * len(self.servers)

        def connect(i: int, s: int) -> None:
            try:
                results[i] = PairChannel(store, s, self.client, self.timeout,
                                         self.connect_timeout, intra_host=self.intra_host)
            except ChannelError as exc:
                results[i] = exc

        threads = [threading.Thread(target=connect, args=(i, s), daemon=True)
                   for i, s in enumerate(self.servers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = next((r for r in results if not isinstance(r, PairChannel)), None)
        if failed is not None:
            for r in results:
                if isinstance(r, PairChannel):
                    r.close()
            raise failed if isinstance(failed, ChannelError) else \
                ChannelError(f"client {self.client}: could not connect to the servers")
        return [r for r in results if isinstance(r, PairChannel)]

    @property
    def shared(self) -> list[bool]:
        """Whether each server's pair goes through this host's shared memory (not Gloo)."""
        return [ch.shared for ch in self._channels]

    # -- requests ---------------------------------------------------------------------------
    def _transaction(self, name: str, nbytes: int | None = None) -> _Held:
        """Hold every channel for one request; with ``nbytes``, book it on the Comm (the
        training's exchanges and pulls)."""
        if self._closed:
            raise ShoalError(f"client {self.client}: used after close()")
        booked = self.comm.point_to_point(name, nbytes) \
            if self.comm is not None and nbytes is not None else None
        return _Held([ch.lock for ch in self._channels], booked)

    def _slice(self, flat: torch.Tensor, i: int, what: str) -> torch.Tensor:
        a, b = self.ranges[i]
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() < b:
            raise ShoalError(f"client {self.client}: {what} must be a contiguous flat vector "
                             f"of at least {b} values")
        return flat[a:b]

    def _request(self, i: int, kind: int, header: Header) -> torch.Tensor:
        """Server ``i``'s header of this request (its rule's fields from ``header``)."""
        ch = self._channels[i]
        if kind == Kind.EXCHANGE:
            missing = [name for name in ch.fields if name not in header.fields]
            if missing:
                raise ShoalError(f"server {self.servers[i]}'s rule reads {', '.join(missing)}, "
                                 "which this exchange's header does not carry")
        return ch.pack(header, kind=kind, client=self.client, version=self.versions[i])

    def _round(self, kind: int, header: Header, payload: torch.Tensor | None,
               reply: torch.Tensor, wait: float) -> None:
        """One request to every server at once, their replies into ``reply``'s slices."""
        messages = []  # all checked before anything is sent
        for i in range(len(self._channels)):
            out = [self._request(i, kind, header)] + ([self._slice(payload, i, "the payload")]
                                                      if payload is not None else [])
            messages.append((out, [self._hin[i], self._slice(reply, i, "the reply")]))
        out_tags = [TAG_HEAD] if payload is None else [TAG_HEAD, TAG_DATA]
        posted: list[tuple[int, Any, Any]] = []
        for i, (ch, (out, back)) in enumerate(zip(self._channels, messages, strict=True)):
            try:
                posted.append((i, ch.isend(out, out_tags), ch.irecv(back, [TAG_HEAD, TAG_DATA])))
            except ChannelError as exc:
                posted.append((i, exc, None))
        first: BaseException | None = None
        for i, sent, back in posted:  # every pending one is finished before raising
            ch = self._channels[i]
            try:
                if isinstance(sent, BaseException):
                    raise sent
                ch.finish(sent)
                ch.finish(back, wait)
                self.versions[i] = ch.check_answer(ch.unpack(self._hin[i])).version
            except ShoalError as exc:
                first = first or exc
        if first is not None:
            raise first

    def exchange(self, payload: torch.Tensor, reply: torch.Tensor, header: Header) -> None:
        """Send every server its slice of the flat ``payload`` (with ``header``), all at
        once, and receive each reply into its slice of the flat ``reply``."""
        nbytes = sum(b - a for a, b in self.ranges) * payload.element_size()
        with self._transaction("push+pull", nbytes):
            self._round(Kind.EXCHANGE, header, payload, reply, 2 * self.timeout)

    def pull(self, reply: torch.Tensor, header: Header | None = None) -> None:
        """Receive every server's shard into its slice of the flat ``reply``."""
        with self._transaction("pull", 0):
            self._round(Kind.PULL, header or Header(Kind.PULL, self.client), None, reply,
                        self.timeout)

    def _index(self, server: int) -> int:
        try:
            return self.servers.index(server)
        except ValueError:
            raise ShoalError(f"client {self.client} is not connected to server {server}") from None

    def report(self, obj: Any, header: Header | None = None,
               timeout: float | None = None, server: int = 0) -> None:
        """Send ``obj`` (picklable) to server ``server``'s ``on_report`` (server 0's: the
        coordinator's); returns once it was handled there, waiting at most ``timeout``
        seconds (default: the channel's) for each of sending and the answer."""
        ch = self._channels[self._index(server)]
        head = replace(header or Header(Kind.REPORT, self.client), client=self.client)
        with self._transaction("report"):
            ch.send_object(obj, Kind.REPORT, head, timeout)
            ch.recv_answer(timeout)

    def fetch_state(self, server: int) -> dict:
        """Server ``server``'s :meth:`~shoal.ps.server.ShardServer.state` (its shard,
        version, rule state, staleness)."""
        ch = self._channels[self._index(server)]
        with self._transaction("state"):
            ch.send([ch.pack(Header(Kind.STATE, self.client))])
            return ch.recv_object()

    def close(self) -> None:
        """Say BYE to every server (each waits for it: a clean leave, not a loss) and leave
        the pairs. Servers already gone are skipped; never raises."""
        if self._closed:
            return
        self._stop_pings()
        wait = min(self.timeout, 10.0)
        for i, ch in enumerate(self._channels):
            with ch.lock, contextlib.suppress(ChannelError):
                ch.send([ch.pack(Header(Kind.BYE, self.client))], wait)
                ch.recv([self._hin[i]], wait)
        self.abandon()

    def abandon(self) -> None:
        """Leave the pairs without a word (after a failure this worker reported): each
        server's thread waiting for its next request sees the connection close now, not
        when this process ends (a job's ranks may go on, as a trial inside a job does).
        Never raises."""
        if self._closed:
            return
        self._stop_pings()
        for ch in self._channels:
            with ch.lock:
                ch.close()
        self._closed = True

    def _stop_pings(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(self.timeout)

    def _keep_alive(self, interval: float) -> None:
        while not self._stop.wait(min(interval / 2, 1.0)):
            for ch in self._channels:
                if time.monotonic() - ch.last_sent < interval or ch.broken is not None:
                    continue
                if ch.lock.acquire(blocking=False):
                    try:
                        ch.send([ch.pack(Header(Kind.PING, self.client))])
                    except ChannelError:
                        pass  # the next request raises it
                    finally:
                        ch.lock.release()


class _Held:
    """The context of one request: booked (``booked``: its time and, once it succeeded,
    its bytes), with every channel's lock held."""

    __slots__ = ("_locks", "_booked")

    def __init__(self, locks: list[threading.Lock],
                 booked: contextlib.AbstractContextManager[None] | None) -> None:
        self._locks, self._booked = locks, booked

    def __enter__(self) -> None:
        if self._booked is not None:
            self._booked.__enter__()
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        for lock in reversed(self._locks):
            lock.release()
        if self._booked is not None:
            self._booked.__exit__(kind, *exc)
