"""The parameter server's transport and serving machinery; it knows no strategy.

An asynchronous job has ``k`` **servers**, each holding one contiguous shard of the flat
parameter vector (the *center*), and **clients**: the workers, and on servers ``s >= 1``
server 0's coordinator. Every (server, client) pair has its own two-rank Gloo process group
(:class:`PairChannel`: ``ProcessGroupGloo`` on ``PrefixStore(f"ps/{server}/{client}", store)``,
server = pair rank 0, client = pair rank 1), and a server serves each client on a thread of
its own (:class:`ShardServer`), so a dead client breaks only its own pair. Built on Gloo's
point-to-point ``send``/``recv``, not on ``torch.distributed.rpc``.

**Messages.** Every request is a :class:`Header` (one small float64 tensor) followed by at
most one payload: the client's whole shard slice (:data:`EXCHANGE`) or a pickled object
(:data:`REPORT`). Every reply is a header and at most one payload (the shard for
:data:`EXCHANGE`/:data:`PULL`, the pickled state for :data:`STATE`). A failure on the server
(an update rule that raised, an exchange held back past the timeout) is answered with an
:data:`ERROR` header and the message, and raised on the client as a one-line
:class:`~shoal.errors.ShoalError`. Headers, vectors and pickled bytes travel on three Gloo
tags (:data:`TAG_HEAD`, :data:`TAG_DATA`, :data:`TAG_BYTES`), so a server posts the receive
of a worker's next vector before its header arrives: Gloo moves a message only once its
receive is posted, and the vector then streams in right behind the header. Measured
(``benchmarks/bench_ps.py``), an exchange costs about what a bare Gloo round trip of the
same vector costs.

**Dead and hung peers.** Gloo fails a pending ``send``/``recv`` as soon as the connection is
reset, so a peer killed with ``kill -9`` is detected within milliseconds, whatever the
other side was waiting for. A peer that is alive but silent (stopped, hung, or computing
longer than ``timeout``) is detected when the wait's ``timeout`` expires. Either way the
pair is broken for good (Gloo closes a pair whose operation timed out): the server marks
that client lost (:attr:`ShardServer.lost`) and serves the others; a client raises
:class:`ChannelError`. A server therefore waits at most ``timeout`` seconds for a client's
next request: a worker that computes longer than that between two exchanges is declared
lost. A client that may be idle for long (the coordinator, between two evaluations) passes
``keepalive`` to :class:`ServerClient`, which then sends a :data:`PING` whenever it has
sent nothing for that long.

**Consistency.** A rule with ``locked = True`` is applied under the shard's lock, one exchange
at a time; ``locked = False`` rules run concurrently (Hogwild on the center). Staleness, the
number of versions applied between a client's last reply and its exchange, is recorded for
every exchange, and can be bounded (``max_staleness``). ``order="round-robin"`` applies
exchanges in worker order (the original EASGD master).
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from shoal.core.timeline import COMM, Timeline
from shoal.errors import ShoalError

#: Message kinds (a request's :attr:`Header.kind`; a reply echoes it).
EXCHANGE, PULL, REPORT, STATE, BYE = range(5)
#: Keep-alive from an idle client (no reply), and a reply that carries an error message.
PING, ERROR = 5, 6
KIND_NAMES = {EXCHANGE: "exchange", PULL: "pull", REPORT: "report", STATE: "state",
              BYE: "bye", PING: "ping", ERROR: "error"}

#: Orders in which a server applies exchanges.
ORDERS = ("arrival", "round-robin")

#: Gloo tags of a pair's messages: each tag's messages are matched in order, so a server
#: can post the receive of a worker's next vector (``TAG_DATA``) before its header arrives.
TAG_HEAD, TAG_DATA, TAG_BYTES = 0, 1, 2


@dataclass
class Header:
    """The fixed-size part of every message; travels as one float64 tensor (exact for
    integers below 2**53) before the payload."""

    kind: int
    client: int
    clock: int = 0  #: this client's number of exchanges so far (set by the caller)
    #: in a request: the server version the client last pulled (set by :class:`ServerClient`
    #: per server); in a reply: the server's version now
    version: int = 0
    step: int = 0  #: the worker's optimizer step count
    samples: int = 0  #: samples this worker has trained on so far
    lr: float = 0.0  #: the worker's current learning rate (its schedule's)
    momentum: float = 0.0
    weight_decay: float = 0.0
    alpha: float = 0.0
    nbytes: int = 0  #: length of a pickled object that follows (REPORT, STATE, ERROR)

    def pack(self) -> torch.Tensor:
        """This header as a float64 tensor of :data:`HEADER_SIZE` values."""
        return torch.tensor([float(getattr(self, name)) for name in _HEADER_FIELDS],
                            dtype=torch.float64)

    @classmethod
    def unpack(cls, t: torch.Tensor) -> Header:
        """The header packed in ``t`` (as :meth:`pack` made it)."""
        values = t.tolist()
        return cls(*(int(v) if f.type in ("int", int) else float(v)
                     for f, v in zip(fields(cls), values, strict=True)))


_HEADER_FIELDS = tuple(f.name for f in fields(Header))
HEADER_SIZE = len(_HEADER_FIELDS)


class ChannelError(ShoalError):
    """The peer of a pair is gone (connection closed: killed, crashed, exited) or was silent
    past the timeout. The message names the pair and the reason, on one line."""

    #: The echo of another process's failure: a launcher reports that one as the cause.
    echo = True


def _reason(exc: BaseException, peer: str, timeout: float) -> str:
    text = str(exc)
    if "Timed out" in text or "timed out" in text or "wait timeout" in text:
        return f"{peer} sent nothing for {timeout:g} s (hung, stopped or too slow)"
    if "closed by peer" in text or "Connection reset" in text or "closure" in text \
            or "Broken pipe" in text or "EPIPE" in text:
        return f"{peer} closed the connection (killed, crashed or exited)"
    first = (text.strip().splitlines() or [type(exc).__name__])[0]
    return f"{peer}: {first[:200]}"


class _Pending:
    """Gloo works posted on one channel, finished by :meth:`PairChannel.finish`."""

    __slots__ = ("works", "what")

    def __init__(self, works: list[Any], what: str) -> None:
        self.works, self.what = works, what


class PairChannel:
    """Two-rank Gloo group between server ``server`` (pair rank 0) and client ``client``
    (pair rank 1), in the store prefix ``ps/{server}/{client}``.

    Connecting waits up to ``connect_timeout`` seconds (default: ``timeout``) for the peer.
    Every send and receive is
    bounded by a timeout; a failure raises :class:`ChannelError` and breaks the channel for
    good (a Gloo pair does not survive a timed-out operation). Tensors travel whole, as one
    message each, and must be contiguous CPU tensors. One exchange at a time: callers
    that share a channel between threads hold :attr:`lock` around a request and its reply.
    """

    def __init__(self, store: dist.Store, server: int, client: int, is_server: bool,
                 timeout: float, connect_timeout: float | None = None) -> None:
        self.server, self.client, self.is_server = server, client, is_server
        self.timeout = float(timeout)
        self.peer = f"client {client}" if is_server else f"server {server}"
        self.name = f"parameter-server pair (server {server}, client {client})"
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.last_sent = time.monotonic()
        self._peer_rank = 1 if is_server else 0
        # A store client of its own: a TCPStore client serializes its calls, and a pair
        # waiting in it for its peer must not hold up the other pairs of this process.
        with contextlib.suppress(RuntimeError, NotImplementedError):
            store = store.clone()
        self._store = store
        prefix = dist.PrefixStore(f"ps/{server}/{client}", store)
        connect = self.timeout if connect_timeout is None else float(connect_timeout)
        try:
            self._pg: Any = dist.ProcessGroupGloo(prefix, 0 if is_server else 1, 2,
                                                  timedelta(seconds=connect))
            self._pg._set_default_timeout(timedelta(seconds=self.timeout))
        except (RuntimeError, ValueError) as exc:
            self._pg = None
            text = str(exc)
            if "timeout" in text or "Timed out" in text or "timed out" in text:
                self.broken = f"{self.peer} did not connect within {connect:g} s"
            else:
                first = (text.strip().splitlines() or [type(exc).__name__])[0][:200]
                self.broken = f"could not connect to {self.peer}: {first}"
            raise ChannelError(f"{self.name}: {self.broken}") from None

    # -- non-blocking halves ----------------------------------------------------------------
    def isend(self, tensors: list[torch.Tensor], tags: Sequence[int] | None = None) -> _Pending:
        """Start sending each of ``tensors`` as one message (with ``tags``, default
        :data:`TAG_HEAD`); :meth:`finish` waits."""
        self._check()
        tags = tags or [TAG_HEAD] * len(tensors)
        try:
            works = [self._pg.send([t], self._peer_rank, tag)
                     for t, tag in zip(tensors, tags, strict=True)]
        except RuntimeError as exc:
            raise self._fail(exc, self.timeout) from None
        self.last_sent = time.monotonic()
        return _Pending(works, "send")

    def irecv(self, tensors: list[torch.Tensor], tags: Sequence[int] | None = None) -> _Pending:
        """Start receiving the next messages of ``tags`` (default :data:`TAG_HEAD`) into
        ``tensors`` (their sizes must match the sent ones'); :meth:`finish` waits."""
        self._check()
        tags = tags or [TAG_HEAD] * len(tensors)
        try:
            works = [self._pg.recv([t], self._peer_rank, tag)
                     for t, tag in zip(tensors, tags, strict=True)]
        except RuntimeError as exc:
            raise self._fail(exc, self.timeout) from None
        return _Pending(works, "recv")

    def finish(self, pending: _Pending, timeout: float | None = None) -> None:
        """Wait for ``pending`` to complete, at most ``timeout`` seconds (default: the
        channel's) in all."""
        limit = self.timeout if timeout is None else float(timeout)
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

    def send_object(self, obj: Any, kind: int = REPORT, header: Header | None = None,
                    timeout: float | None = None) -> None:
        """Send ``obj`` pickled: a header (``kind``, ``nbytes``) and the bytes as uint8."""
        data = _to_bytes(obj)
        head = replace(header or Header(kind, self.client), kind=kind, nbytes=data.numel())
        self.send([head.pack(), data], timeout, [TAG_HEAD, TAG_BYTES])

    def recv_object(self, timeout: float | None = None) -> Any:
        """Receive what :meth:`send_object` sent; an :data:`ERROR` header raises its message
        as a :class:`~shoal.errors.ShoalError`."""
        hbuf = torch.empty(HEADER_SIZE, dtype=torch.float64)
        self.recv([hbuf], timeout)
        head = Header.unpack(hbuf)
        data = self.recv_bytes(head.nbytes, timeout)
        if head.kind == ERROR:
            raise ShoalError(f"server {self.server}: {_from_bytes(data)}")
        return _from_bytes(data)

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
        self._pg = None

    # -- failures ---------------------------------------------------------------------------
    def _check(self) -> None:
        if self.broken is not None:
            raise ChannelError(f"{self.name}: {self.broken}")

    def _fail(self, exc: BaseException, timeout: float) -> ChannelError:
        if self.broken is None:
            self.broken = _reason(exc, self.peer, timeout)
        return ChannelError(f"{self.name}: {self.broken}")


def _to_bytes(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _from_bytes(buf: torch.Tensor) -> Any:
    return pickle.loads(buf.numpy().tobytes())


@runtime_checkable
class ServerRule(Protocol):
    """How a server updates its shard on an :data:`EXCHANGE` (one per strategy).

    ``locked``: ``True`` applies one exchange at a time under the shard's lock; ``False``
    lets exchanges of different clients run concurrently (in place, lock free).
    """

    locked: bool

    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        """``payload``: this shard's slice of what the worker sent (gradient or x_i);
        fill ``reply`` with this shard's slice to send back (new parameters, or x~ before
        the update). The center is the rule's own (it was built on it)."""

    def state_dict(self) -> dict:
        """The rule's state (momentum buffers, step counts) for a checkpoint."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""


def _detach(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are clones (a checkpoint that later updates do not
    change)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach(v) for v in obj)
    return obj


class _Refused(ShoalError):
    """A request the server answers with an error and goes on (an exchange held back past
    the timeout, an exchange with a server that has no rule)."""


class ShardServer:
    """Serves one contiguous shard ``center`` (float32, updated in place by ``rule``) to
    ``clients`` clients, a thread per client.

    Clients ``0 .. workers-1`` are workers (``workers`` defaults to ``clients``); the
    others (the coordinator) only pull, report and fetch state, and take no part in the
    order or the staleness bound. ``pushers`` (default: every worker) are the workers that
    exchange: the others (the members of a compute group other than its leader) only pull
    and report, and take no part in the order or the bound either. ``timeout`` (seconds)
    bounds every wait for a client: a client silent for longer is declared lost;
    ``connect_timeout`` (default: ``timeout``) is how long a client may take to connect (its
    process starting, importing torch).

    ``max_staleness=k`` applies an exchange only when, after it, the other live workers can
    still all push with a staleness of at most ``k`` (in order of their last pull: the
    one that pulled longest ago first); the pusher waits meanwhile (for others to push or be
    lost, at most ``timeout``). Exchanges are then never applied with a staleness above
    ``k``, and the worker that pulled longest ago can always go, so progress needs only
    ``k >= workers - 1``; a smaller ``k`` is refused. ``order="round-robin"`` applies worker
    ``w``'s n-th exchange after worker ``w-1``'s n-th (lost and finished workers skipped).

    ``on_report(client, obj)`` receives what a client sends with :meth:`ServerClient.report`
    (one call at a time); ``extra_state()``'s value goes into :meth:`state` as ``"extra"``;
    ``on_lost(client, record)`` is called when a client is declared lost.
    """

    def __init__(self, store: dist.Store, server: int, clients: int, rule: ServerRule | None,
                 center: torch.Tensor, *, timeout: float, max_staleness: int | None = None,
                 order: str = "arrival", workers: int | None = None,
                 pushers: Sequence[int] | None = None,
                 on_report: Callable[[int, Any], None] | None = None,
                 extra_state: Callable[[], Any] | None = None,
                 on_lost: Callable[[int, dict], None] | None = None,
                 connect_timeout: float | None = None) -> None:
        workers = clients if workers is None else int(workers)
        if not 0 <= workers <= clients:
            raise ShoalError(f"server {server}: {workers} workers among {clients} clients")
        if order not in ORDERS:
            raise ShoalError(f"unknown order {order!r}; choose from {', '.join(ORDERS)}")
        pushers = list(range(workers)) if pushers is None else sorted(set(pushers))
        if any(not 0 <= p < workers for p in pushers):
            raise ShoalError(f"server {server}: pushers {pushers} must be among the "
                             f"{workers} workers")
        n = len(pushers)
        if max_staleness is not None and max_staleness < max(n - 1, 0):
            raise ShoalError(f"max staleness {max_staleness} is below pushers - 1 = "
                             f"{n - 1}: with {n} workers pushing no exchange could proceed")
        if center.dim() != 1 or not center.is_contiguous():
            raise ShoalError("a server's center must be a contiguous 1-D tensor")
        if not timeout > 0:
            raise ShoalError(f"timeout must be a positive number of seconds, got {timeout}")
        self.store, self.server, self.clients, self.workers = store, server, clients, workers
        self.pushers = pushers
        self.rule, self.center, self.timeout = rule, center, float(timeout)
        self.connect_timeout = self.timeout if connect_timeout is None else float(connect_timeout)
        self.max_staleness, self.order = max_staleness, order
        self.on_report, self.extra_state, self.on_lost = on_report, extra_state, on_lost
        self.locked = True if rule is None else bool(getattr(rule, "locked", True))

        self.version = 0  #: exchanges applied (restored by :meth:`load_state`)
        #: staleness of every applied exchange: versions applied between the client's last
        #: reply from this server and its exchange
        self.staleness: collections.Counter = collections.Counter()
        #: client -> {"time", "error", "step", "samples", "clock"} of clients declared lost
        self.lost: dict[int, dict] = {}
        #: last clock, step and samples per client (from its exchanges and pulls)
        self.clocks: dict[int, int] = {}
        self.steps: dict[int, int] = {}
        self.samples: dict[int, int] = {}
        self.left: set[int] = set()  #: clients that said BYE
        self.applied: collections.deque[int] = collections.deque(maxlen=100_000)
        #: ^ the clients of the last applied exchanges, in application order
        self.errors: list[str] = []  #: failures of the server itself (rule, on_report)
        self._pulled: dict[int, int] = {}  # version of each client's last reply
        self._counts: dict[int, int] = collections.defaultdict(int)  # exchanges per client
        self._cond = threading.Condition()  # the shard's lock
        self._report_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._channels: dict[int, PairChannel] = {}
        self._closing = False
        self._started = False

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to every client and serve it, each on its own (daemon) thread."""
        if self._started:
            return
        self._started = True
        with self._cond:
            for c in range(self.clients):
                self._pulled.setdefault(c, self.version)
        for c in range(self.clients):
            t = threading.Thread(target=self._serve, args=(c,), daemon=True,
                                 name=f"shoal-ps{self.server}-client{c}")
            self._threads.append(t)
            t.start()

    def done(self) -> bool:
        """Whether every client said BYE or was declared lost."""
        with self._cond:
            return len(self.left) + len(self.lost) >= self.clients

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every client said BYE or was lost (``True``), at most ``timeout``
        seconds (``False``); then the serving threads have left their pairs. Raises a
        :class:`~shoal.errors.ShoalError` if serving failed (the rule or ``on_report``
        raised)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self.left) + len(self.lost) < self.clients and not self.errors:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(1.0 if left is None else min(left, 1.0))
            if self.errors:
                raise ShoalError(f"server {self.server}: {self.errors[0]}")
            done = len(self.left) + len(self.lost) >= self.clients
        if done:  # the threads are answering their last BYE: let them leave their pairs
            limit = 5.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
            end = time.monotonic() + limit
            for t in self._threads:
                t.join(max(end - time.monotonic(), 0.0))
        return done

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving: wait up to ``timeout`` seconds for the serving threads. A thread
        still waiting on a silent client (Gloo cannot interrupt a pending receive) ends at
        its own timeout, or with the process (the threads are daemons)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.0))

    # -- state ------------------------------------------------------------------------------
    def snapshot(self) -> torch.Tensor:
        """A copy of the center (under the shard's lock)."""
        with self._cond:
            return self.center.clone()

    def state(self) -> dict:
        """``{"center", "version", "rule", "staleness", "lost", "clocks"}`` (and ``"extra"``
        when ``extra_state`` was given), consistent: taken under the shard's lock."""
        with self._cond:
            out = {"center": self.center.clone(), "version": self.version,
                   "rule": _detach(self.rule.state_dict()) if self.rule is not None else {},
                   "staleness": dict(self.staleness), "lost": dict(self.lost),
                   "clocks": dict(self.clocks)}
        if self.extra_state is not None:
            out["extra"] = self.extra_state()
        return out

    def load_state(self, state: dict) -> None:
        """Restore what :meth:`state` returned (before :meth:`start`, for ``--resume``)."""
        with self._cond:
            center = state["center"]
            if center.numel() != self.center.numel():
                raise ShoalError(f"server {self.server}: the checkpoint's shard has "
                                 f"{center.numel()} values, this one {self.center.numel()}")
            self.center.copy_(center)
            self.version = int(state.get("version", 0))
            if self.rule is not None and state.get("rule"):
                self.rule.load_state_dict(state["rule"])
            self.staleness = collections.Counter(
                {int(k): int(v) for k, v in state.get("staleness", {}).items()})
            self.clocks.update(state.get("clocks", {}))
            for c in self._pulled:
                self._pulled[c] = self.version

    # -- bookkeeping ------------------------------------------------------------------------
    def _lose(self, c: int, error: str) -> None:
        with self._cond:
            if c in self.left or c in self.lost or self._closing:
                return
            record = {"time": time.time(), "error": error, "step": self.steps.get(c, 0),
                      "samples": self.samples.get(c, 0), "clock": self.clocks.get(c, 0)}
            self.lost[c] = record
            self._cond.notify_all()
        if self.on_lost is not None:
            try:
                self.on_lost(c, record)
            except Exception as exc:  # the caller's; it must not take the thread down quietly
                self._failed(f"on_lost raised {type(exc).__name__}: {exc}")

    def _failed(self, message: str) -> None:
        with self._cond:
            self.errors.append(message.strip().splitlines()[0] if message.strip() else message)
            self._cond.notify_all()

    def _live_pushers(self) -> list[int]:
        return [w for w in self.pushers if w not in self.lost and w not in self.left]

    def _blockers(self, c: int) -> list[int]:
        """The workers the exchange of client ``c`` must wait for now (empty: apply it)."""
        if c not in self.pushers:
            return []
        live = [w for w in self._live_pushers() if w != c]
        if self.order == "round-robin":
            n = self._counts[c]
            before = [u for u in live if (u < c and self._counts[u] <= n)
                      or (u > c and self._counts[u] < n)]
            if before:
                return before
        if self.max_staleness is not None:
            after = self.version + 1
            ranked = sorted(live, key=lambda u: self._pulled[u])
            for j, u in enumerate(ranked):
                if after + j - self._pulled[u] > self.max_staleness:
                    return ranked[:j + 1]
        return []

    def _admit(self, c: int) -> None:
        """Wait (holding the shard's condition) until client ``c``'s exchange may go."""
        if self.order == "arrival" and self.max_staleness is None:
            return
        deadline = time.monotonic() + self.timeout
        while True:
            blockers = self._blockers(c)
            if not blockers:
                return
            left = deadline - time.monotonic()
            if self._closing:
                raise _Refused(f"server {self.server} is shutting down")
            if left <= 0:
                why = "round-robin order" if self.order == "round-robin" else \
                    f"staleness bound {self.max_staleness}"
                raise _Refused(f"the exchange of client {c} was held back {self.timeout:g} s by "
                            f"the {why}, waiting for worker(s) "
                            f"{', '.join(map(str, blockers))}")
            self._cond.wait(min(left, 1.0))

    def _book(self, c: int) -> int:
        """Record client ``c``'s exchange as applied now; returns the new version."""
        self.staleness[self.version - self._pulled[c]] += 1
        self.version += 1
        self._counts[c] += 1
        self._pulled[c] = self.version
        self.applied.append(c)
        self._cond.notify_all()
        return self.version

    def _exchange(self, c: int, header: Header, payload: torch.Tensor,
                  reply: torch.Tensor) -> int:
        if self.rule is None:
            raise _Refused(f"server {self.server} has no update rule: it only serves pulls")
        with self._cond:
            self._admit(c)
            if self.locked:
                self.rule.apply(header, payload, reply)
                return self._book(c)
            version = self._book(c)
        self.rule.apply(header, payload, reply)  # lock free: concurrent with the others
        return version

    # -- serving ----------------------------------------------------------------------------
    def _serve(self, c: int) -> None:
        try:
            ch = PairChannel(self.store, self.server, c, True, self.timeout,
                             self.connect_timeout)
        except ChannelError as exc:
            self._lose(c, str(exc))
            return
        self._channels[c] = ch
        pushes = c in self.pushers
        session = _Session(ch, self.center if pushes else None)
        try:
            while not self._closing:
                if pushes:
                    session.expect_payload()  # before the header: no rendezvous after it
                ch.recv([session.head], tags=[TAG_HEAD])
                head = Header.unpack(session.head)
                if head.kind in (EXCHANGE, PULL):  # the requests that carry progress
                    with self._cond:
                        self.clocks[c], self.steps[c], self.samples[c] = \
                            head.clock, head.step, head.samples
                if head.kind == PING:
                    continue
                if head.kind not in (EXCHANGE, PULL, REPORT, STATE, BYE):
                    raise ChannelError(f"{ch.name}: unknown message kind {head.kind}")
                if session.payload is None and head.kind in (EXCHANGE, PULL):
                    session.allocate(self.center)
                if self._handle(c, session, head):
                    break
        except ChannelError as exc:
            self._lose(c, str(exc))
        except Exception as exc:  # a bug on this side (a report that does not unpickle...)
            self._failed(f"serving client {c} failed: {type(exc).__name__}: {exc}")
            self._lose(c, f"{ch.name}: the server failed serving it")
        finally:
            ch.close()
            with self._cond:
                self._cond.notify_all()

    def _handle(self, c: int, session: _Session, head: Header) -> bool:
        """Answer one request of client ``c``; ``True`` when the client left."""
        ch = session.channel
        error: str | None = None
        kind = head.kind
        if kind == EXCHANGE:
            payload, reply = session.receive_payload()
            try:
                version = self._exchange(c, head, payload, reply)
            except _Refused as exc:
                error, version = str(exc), self.version
            except Exception as exc:
                error, version = f"{type(exc).__name__}: {exc}", self.version
                self._failed(f"the update rule failed on client {c}'s exchange: {error}")
            self._reply(ch, c, kind, version, reply, error)
        elif kind == PULL:
            reply = session.reply
            assert reply is not None
            with self._cond:
                reply.copy_(self.center)
                version = self._pulled[c] = self.version
                self._cond.notify_all()  # a fresher pull can unblock the staleness bound
            self._reply(ch, c, kind, version, reply, None)
        elif kind == REPORT:
            obj = _from_bytes(ch.recv_bytes(head.nbytes))
            if self.on_report is None:
                error = f"server {self.server} takes no reports"
            else:
                try:
                    with self._report_lock:
                        self.on_report(c, obj)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    self._failed(f"handling client {c}'s report failed: {error}")
            self._reply(ch, c, kind, self.version, None, error)
        elif kind == STATE:
            try:
                data: torch.Tensor | None = _to_bytes(self.state())
            except Exception as exc:
                data, error = None, f"{type(exc).__name__}: {exc}"
            if error is None and data is not None:
                head = Header(STATE, c, version=self.version, nbytes=data.numel())
                ch.send([head.pack(), data], tags=[TAG_HEAD, TAG_BYTES])
            else:
                self._reply(ch, c, kind, self.version, None, error)
        else:  # BYE
            with self._cond:
                self.left.add(c)
                self._cond.notify_all()
            with contextlib.suppress(ChannelError):  # it may be gone already: it left
                self._reply(ch, c, kind, self.version, None, None)
            return True
        return False

    def _reply(self, ch: PairChannel, c: int, kind: int, version: int,
               vector: torch.Tensor | None, error: str | None) -> None:
        """Header (and the vector the client expects, even with an error: the client has
        posted its receive), then the error message."""
        out = [Header(kind if error is None else ERROR, c, version=version).pack()]
        tags = [TAG_HEAD]
        if vector is not None:
            out.append(vector)
            tags.append(TAG_DATA)
        if error is not None:
            data = _to_bytes(error.strip().splitlines()[0] if error.strip() else error)
            out[0] = Header(ERROR, c, version=version, nbytes=data.numel()).pack()
            out.append(data)
            tags.append(TAG_BYTES)
        ch.send(out, tags=tags)


class _Session:
    """A serving thread's buffers for one client: its header, the payload and reply
    vectors (a shard each), and the payload's receive, posted ahead of the header."""

    def __init__(self, channel: PairChannel, center: torch.Tensor | None) -> None:
        self.channel = channel
        self.head = torch.empty(HEADER_SIZE, dtype=torch.float64)
        self.payload: torch.Tensor | None = None
        self.reply: torch.Tensor | None = None
        self._posted: _Pending | None = None
        if center is not None:
            self.allocate(center)

    def allocate(self, center: torch.Tensor) -> None:
        self.payload, self.reply = torch.empty_like(center), torch.empty_like(center)

    def expect_payload(self) -> None:
        """Post the receive of the next payload (once): Gloo hands a message over only when
        its receive is posted, so posting it ahead saves a round of that handshake. It is
        matched by tag, so other requests in between leave it waiting."""
        if self._posted is None:
            assert self.payload is not None
            self._posted = self.channel.irecv([self.payload], tags=[TAG_DATA])

    def receive_payload(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.expect_payload()
        assert self._posted is not None and self.reply is not None and self.payload is not None
        pending, self._posted = self._posted, None
        self.channel.finish(pending)
        return self.payload, self.reply


class ServerClient:
    """A worker's (or the coordinator's) end: one :class:`PairChannel` per server.

    ``ranges[i] = (start, end)`` is server ``servers[i]``'s shard in the flat vector
    (``servers`` defaults to ``0 .. len(ranges)-1``). Communication time is booked as
    ``COMM`` spans on ``timeline``; the payload bytes sent go to ``count``. With
    ``keepalive`` (seconds), a background thread sends a :data:`PING` on every channel that
    has sent nothing for that long, so an idle client (the coordinator) is not declared
    lost; it must be below the servers' ``timeout``.

    The client fills each request's ``kind``, ``client`` and (per server) ``version``; the
    other header fields (clock, step, samples, lr, ...) are the caller's. A reply to an
    exchange may be held back by the server's staleness bound or round-robin order for up
    to ``timeout``, so an exchange waits up to twice ``timeout`` for it. Connecting waits
    up to ``connect_timeout`` (default: ``timeout``) for each server, all at once.
    """

    def __init__(self, store: dist.Store, client: int, ranges: list[tuple[int, int]], *,
                 timeout: float, servers: list[int] | None = None,
                 timeline: Timeline | None = None, count: Callable[[int], None] | None = None,
                 keepalive: float | None = None, connect_timeout: float | None = None) -> None:
        servers = list(range(len(ranges))) if servers is None else list(servers)
        if len(servers) != len(ranges):
            raise ShoalError(f"client {client}: {len(ranges)} shard ranges for "
                             f"{len(servers)} servers")
        if keepalive is not None and not 0 < keepalive < timeout:
            raise ShoalError(f"keepalive must be between 0 and the timeout ({timeout:g} s), "
                             f"got {keepalive}")
        self.client, self.ranges, self.servers = client, [tuple(r) for r in ranges], servers
        self.timeout, self.timeline, self._count = float(timeout), timeline, count
        self.connect_timeout = self.timeout if connect_timeout is None else float(connect_timeout)
        self.versions = [0] * len(servers)  #: last version seen per server
        self._hin = [torch.empty(HEADER_SIZE, dtype=torch.float64) for _ in servers]
        self._channels = self._connect(store)
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
                results[i] = PairChannel(store, s, self.client, False, self.timeout,
                                         self.connect_timeout)
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

    # -- requests ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self, name: str, timed: bool = True) -> Iterator[None]:
        """Hold every channel for one request; ``timed``: book it as a ``COMM`` span (the
        training's exchanges; not the reports, which are bookkeeping, as a synchronous run's
        metric reductions are)."""
        if self._closed:
            raise ShoalError(f"client {self.client}: used after close()")
        span = self.timeline.span(COMM, name) if self.timeline is not None and timed \
            else contextlib.nullcontext()
        with span, contextlib.ExitStack() as locks:
            for ch in self._channels:
                locks.enter_context(ch.lock)
            yield

    def _slice(self, flat: torch.Tensor, i: int, what: str) -> torch.Tensor:
        a, b = self.ranges[i]
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() < b:
            raise ShoalError(f"client {self.client}: {what} must be a contiguous flat vector "
                             f"of at least {b} values")
        return flat[a:b]

    def _round(self, kind: int, header: Header, payload: torch.Tensor | None,
               reply: torch.Tensor, wait: float) -> None:
        """One request to every server at once, their replies into ``reply``'s slices."""
        messages = []  # all checked before anything is sent
        for i in range(len(self._channels)):
            head = replace(header, kind=kind, client=self.client, version=self.versions[i])
            out = [head.pack()] + ([self._slice(payload, i, "the payload")]
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
                answer = Header.unpack(self._hin[i])
                if answer.kind == ERROR:
                    message = _from_bytes(ch.recv_bytes(answer.nbytes))
                    raise ShoalError(f"server {self.servers[i]}: {message}")
                self.versions[i] = answer.version
            except ShoalError as exc:
                first = first or exc
        if first is not None:
            raise first

    def exchange(self, payload: torch.Tensor, reply: torch.Tensor, header: Header) -> None:
        """Send every server its slice of the flat ``payload`` (with ``header``), all at
        once, and receive each reply into its slice of the flat ``reply``."""
        with self._transaction("push+pull"):
            self._round(EXCHANGE, header, payload, reply, 2 * self.timeout)
        if self._count is not None:
            self._count(sum(b - a for a, b in self.ranges) * payload.element_size())

    def pull(self, reply: torch.Tensor, header: Header) -> None:
        """Receive every server's shard into its slice of the flat ``reply``."""
        with self._transaction("pull"):
            self._round(PULL, header, None, reply, self.timeout)

    def _index(self, server: int) -> int:
        try:
            return self.servers.index(server)
        except ValueError:
            raise ShoalError(f"client {self.client} is not connected to server {server}") from None

    def report(self, obj: Any, header: Header | None = None,
               timeout: float | None = None) -> None:
        """Send ``obj`` (picklable) to server 0's ``on_report``; returns once it was
        handled there, waiting at most ``timeout`` seconds (default: the channel's) for
        each of sending and the answer."""
        i = self._index(0)
        ch = self._channels[i]
        head = replace(header or Header(REPORT, self.client), client=self.client)
        with self._transaction("report", timed=False):
            ch.send_object(obj, REPORT, head, timeout)
            ch.recv([self._hin[i]], timeout)
            answer = Header.unpack(self._hin[i])
            if answer.kind == ERROR:
                raise ShoalError(f"server 0: {_from_bytes(ch.recv_bytes(answer.nbytes))}")

    def fetch_state(self, server: int) -> dict:
        """Server ``server``'s :meth:`ShardServer.state` (its shard, version, rule state)."""
        ch = self._channels[self._index(server)]
        with self._transaction("state", timed=False):
            ch.send([Header(STATE, self.client).pack()])
            return ch.recv_object()

    def close(self) -> None:
        """Say BYE to every server (each waits for it: a clean leave, not a loss) and leave
        the pairs. Servers already gone are skipped; never raises."""
        if self._closed:
            return
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(self.timeout)
        wait = min(self.timeout, 10.0)
        for i, ch in enumerate(self._channels):
            with ch.lock, contextlib.suppress(ChannelError):
                ch.send([Header(BYE, self.client).pack()], wait)
                ch.recv([self._hin[i]], wait)
        for ch in self._channels:
            ch.close()
        self._closed = True

    def _keep_alive(self, interval: float) -> None:
        while not self._stop.wait(min(interval / 2, 1.0)):
            for ch in self._channels:
                if time.monotonic() - ch.last_sent < interval or ch.broken is not None:
                    continue
                if ch.lock.acquire(blocking=False):
                    try:
                        ch.send([Header(PING, self.client).pack()])
                    except ChannelError:
                        pass  # the next request raises it
                    finally:
                        ch.lock.release()


class LoopbackClient:
    """:class:`ServerClient`'s interface in one process, without a server: each exchange
    applies ``rules[i]`` to shard ``i`` directly (``centers[i]``, which the rule was built
    on), under a lock per shard for locked rules. For a single worker and for the reference
    tests. ``on_report(client, obj)`` receives reports (default: kept in :attr:`reports`).
    """

    def __init__(self, rules: list[ServerRule], centers: list[torch.Tensor],
                 ranges: list[tuple[int, int]] | None = None, *, client: int = 0,
                 timeline: Timeline | None = None, count: Callable[[int], None] | None = None,
                 on_report: Callable[[int, Any], None] | None = None) -> None:
        if len(rules) != len(centers):
            raise ShoalError(f"{len(rules)} rules for {len(centers)} shards")
        if ranges is None:
            ranges, start = [], 0
            for c in centers:
                ranges.append((start, start + c.numel()))
                start += c.numel()
        self.rules, self.centers, self.ranges = rules, centers, [tuple(r) for r in ranges]
        self.client, self.timeline, self._count = client, timeline, count
        self.servers = list(range(len(centers)))
        self.versions = [0] * len(centers)
        self.reports: list[Any] = []
        self._on_report = on_report
        self._locks = [threading.Lock() for _ in centers]

    def _span(self, name: str) -> contextlib.AbstractContextManager:
        return self.timeline.span(COMM, name) if self.timeline is not None \
            else contextlib.nullcontext()

    def exchange(self, payload: torch.Tensor, reply: torch.Tensor, header: Header) -> None:
        """Apply every shard's rule to its slice of ``payload``; replies into ``reply``."""
        with self._span("push+pull"):
            for i, (a, b) in enumerate(self.ranges):
                head = replace(header, kind=EXCHANGE, client=self.client, version=self.versions[i])
                lock = self._locks[i] if getattr(self.rules[i], "locked", True) \
                    else contextlib.nullcontext()
                with lock:
                    self.rules[i].apply(head, payload[a:b], reply[a:b])
                    self.versions[i] += 1
        if self._count is not None:
            self._count(sum(b - a for a, b in self.ranges) * payload.element_size())

    def pull(self, reply: torch.Tensor, header: Header) -> None:
        """Copy every shard into its slice of ``reply``."""
        with self._span("pull"):
            for i, (a, b) in enumerate(self.ranges):
                with self._locks[i]:
                    reply[a:b].copy_(self.centers[i])

    def report(self, obj: Any, header: Header | None = None) -> None:
        """Hand ``obj`` to ``on_report`` (or keep it in :attr:`reports`)."""
        if self._on_report is not None:
            self._on_report(self.client, obj)
        else:
            self.reports.append(obj)

    def fetch_state(self, server: int) -> dict:
        """Shard ``server``'s state, as :meth:`ShardServer.state` gives it."""
        with self._locks[server]:
            return {"center": self.centers[server].clone(), "version": self.versions[server],
                    "rule": _detach(self.rules[server].state_dict())}

    def close(self) -> None:
        """Nothing to leave."""
