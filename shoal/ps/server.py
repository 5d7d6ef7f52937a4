"""A parameter server's shard: :class:`ShardServer` serves one contiguous slice of the
center to every client, each on a thread and a pair of its own.

A request is answered by the entry of the dispatch table (:meth:`ShardServer._handlers`)
for its kind: an EXCHANGE is admitted (:mod:`shoal.ps.admission`), applied by the shard's
:class:`ServerRule` and answered with the rule's reply; a PULL is answered with the shard,
a REPORT handed to ``on_report``, a STATE answered with :meth:`ShardServer.state`, a BYE
is a clean leave. A failure on the server (a rule that raised, an exchange held back past
the timeout) is answered with an ERROR header and its message, which the client raises as
one line; a client whose pair breaks (killed, silent past ``timeout``) is marked lost and
the others are served on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.header import TAG_BYTES, TAG_HEAD, Header, Kind, from_bytes, to_bytes
from shoal.core.pairs import ChannelError, PairChannel
from shoal.errors import ShoalError
from shoal.ps.admission import HOLD, Admission, Ledger
from shoal.ps.rule import Locking, NamedFields, ServerRule, tell
from shoal.ps.session import Session


class Refused(ShoalError):
    """A request the server answers with an error and goes on (an exchange held back past
    the timeout, an exchange with a server that has no rule)."""


class ShardServer:
    """Serves one contiguous shard ``center`` (float32, updated in place by ``rule``) to
    ``clients`` clients, a thread per client.

    ``admission`` (default: every client pushes, in arrival order, unbounded) names the
    clients that exchange and when an exchange may go; the others (the coordinator, the
    members of a compute group other than its leader) only pull, report and fetch state.
    ``timeout`` (seconds) bounds every wait for a client: a client silent for longer is
    declared lost, and an exchange held back 1.5 times as long is refused (a silent worker
    it waits for is lost first). ``connect_timeout`` (default: ``timeout``): how long a
    client may take to connect (its process starting).
    ``on_report(client, obj)`` receives what a client reports (one call at a time).
    ``readers``: ids beyond ``0 .. clients-1`` served too, that never push (server 0 on the
    other servers: its id is outside every worker's, joiners' included).
    """

    def __init__(self, store: dist.Store, server: int, clients: int, rule: ServerRule | None,
                 center: torch.Tensor, *, timeout: float, admission: Admission | None = None,
                 on_report: Callable[[int, Any], None] | None = None,
                 connect_timeout: float | None = None, readers: tuple[int, ...] = (),
                 intra_host: str = "auto") -> None:
        admission = admission or Admission(tuple(range(clients)))
        if any(not 0 <= p < clients for p in admission.pushers):
            raise ShoalError(f"server {server}: pushers {list(admission.pushers)} must be "
                             f"among the {clients} clients")
        if center.dim() != 1 or not center.is_contiguous():
            raise ShoalError("a server's center must be a contiguous 1-D tensor")
        if not timeout > 0:
            raise ShoalError(f"timeout must be a positive number of seconds, got {timeout}")
        self.store, self.server, self.clients = store, server, clients
        self.ids = set(range(clients)) | set(readers)  #: every client's (added ones too)
        #: an added client's first pull's reply (``None``: it has not pulled yet)
        self.first_pulls: dict[int, torch.Tensor | None] = {}
        self.connect_timeouts: dict[int, float] = {}  #: an added client's
        self.rule, self.center, self.admission = rule, center, admission
        self.timeout = float(timeout)
        self.connect_timeout = self.timeout if connect_timeout is None else float(connect_timeout)
        self.on_report, self.intra_host = on_report, intra_host
        self.locked = bool(rule.locked) if isinstance(rule, Locking) else True
        self.fields: tuple[str, ...] = tuple(rule.fields) if isinstance(rule, NamedFields) else ()
        self.ledger = Ledger(clients)  #: versions, staleness (restored by :meth:`load_state`)
        #: client -> {"time", "error", "step", "samples", "clock", "counted"} of clients lost
        self.lost: dict[int, dict] = {}
        #: last clock, step and samples per client (from its exchanges and pulls)
        self.clocks: dict[int, int] = {}
        self.steps: dict[int, int] = {}
        self.samples: dict[int, int] = {}
        #: per client, the ``samples`` of its last exchange applied: its work that counts
        self.counted: dict[int, int] = {}
        self.left: set[int] = set()  #: clients that said BYE
        self.resting: set[int] = set()  #: pushers that push nothing for now (:meth:`rest`)
        self.errors: list[str] = []  #: failures of the server itself (rule, on_report)
        self._cond = threading.Condition()  # the shard's lock
        self._report_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._handlers = {Kind.EXCHANGE: self._on_exchange, Kind.PULL: self._on_pull,
                          Kind.REPORT: self._on_report, Kind.STATE: self._on_state,
                          Kind.BYE: self._on_bye}

    @property
    def version(self) -> int:
        """Exchanges applied to this shard."""
        return self.ledger.version

    @property
    def staleness(self) -> dict[int, int]:
        """Staleness -> exchanges applied with it."""
        return self.ledger.staleness

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to every client and serve it, each on its own (daemon) thread."""
        if self._threads:
            return
        for c in sorted(self.ids):
            self._serving(c).start()

    def _serving(self, c: int) -> threading.Thread:
        """Client ``c``'s serving thread (a daemon), kept to be joined; not started."""
        self._threads.append(threading.Thread(target=self._serve, args=(c,), daemon=True,
                                              name=f"shoal-ps{self.server}-client{c}"))
        return self._threads[-1]

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every client said BYE or was lost (``True``), at most ``timeout``
        seconds (``False``); then the serving threads have left their pairs. Raises a
        :class:`~shoal.errors.ShoalError` if serving failed (the rule or ``on_report``
        raised)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._all_gone() and not self.errors:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(1.0 if left is None else min(left, 1.0))
            if self.errors:
                raise ShoalError(f"server {self.server}: {self.errors[0]}")
            done = self._all_gone()
        if done:  # the threads are answering their last BYE: let them leave their pairs
            limit = 5.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
            end = time.monotonic() + limit
            for t in self._threads:
                t.join(max(end - time.monotonic(), 0.0))
        return done

    def _all_gone(self) -> bool:
        return self.ids <= self.left | self.lost.keys()

    def add_client(self, c: int, connect_timeout: float) -> None:
        """Serve a new pusher ``c`` (a worker that joined the running job, connecting within
        ``connect_timeout`` s) from now on: it takes its turn as the pushers active now do
        (round robin); raises a :class:`~shoal.errors.ShoalError` where the staleness bound
        cannot take one more."""
        with self._cond:
            live = [w for w in self.admission.pushers if w not in self.lost and w not in self.left]
            self.admission = dataclasses.replace(self.admission, pushers=(*live, c))
            self.ids.add(c)
            self.ledger.pulled[c] = self.ledger.version
            self.ledger.rejoin(c, self._active(c))
            self.first_pulls[c], self.connect_timeouts[c] = None, connect_timeout
            t = self._serving(c)
        t.start()

    def lead(self, c: int) -> None:
        """Client ``c`` (a compute group's member, served already) pushes from now on in
        its lost leader's place: it takes its turn as the pushers active now do."""
        with self._cond:
            live = [w for w in self.admission.pushers if w not in self.lost and w not in self.left]
            if c not in live:
                self.admission = dataclasses.replace(self.admission, pushers=(*live, c))
                self.ledger.rejoin(c, self._active(c))

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
        """``{"center", "version", "rule", "staleness", "lost", "clocks", "counted",
        "first_pulls"}`` (the last for the join records), consistent: under the shard's lock."""
        with self._cond:
            first = {c: t for c, t in self.first_pulls.items() if t is not None}
            return {"center": self.center.clone(), "version": self.version,
                    "rule": copy.deepcopy(self.rule.state_dict()) if self.rule is not None else {},
                    "staleness": dict(self.staleness), "lost": dict(self.lost),
                    "clocks": dict(self.clocks), "counted": dict(self.counted),
                    "first_pulls": first}

    def load_state(self, state: dict) -> None:
        """Restore what :meth:`state` returned (before :meth:`start`, for ``--resume``)."""
        with self._cond:
            center = state["center"]
            if center.numel() != self.center.numel():
                raise ShoalError(f"server {self.server}: the checkpoint's shard has "
                                 f"{center.numel()} values, this one {self.center.numel()}")
            self.center.copy_(center)
            if self.rule is not None and state.get("rule"):
                self.rule.load_state_dict(state["rule"])
            self.ledger.restore(state.get("version", 0), state.get("staleness", {}))
            self.clocks.update(state.get("clocks", {}))
            self.counted.update(state.get("counted", {}))  # --elastic: a resumed worker's

    def rest(self, c: int, resting: bool) -> None:
        """Pusher ``c`` pushes nothing for now (``resting``: an elastic worker done with its
        schedule, waiting for more), so no exchange waits for it; or it pushes again."""
        with self._cond:
            if resting:
                self.resting.add(c)
            elif c in self.resting:
                self.resting.discard(c)
                self.ledger.rejoin(c, self._active(c))
            self._cond.notify_all()

    def _active(self, c: int) -> list[int]:
        """The pushers other than ``c`` that may push now (not lost, gone or resting)."""
        return [w for w in self.admission.pushers if w != c and w not in self.lost
                and w not in self.left and w not in self.resting]

    # -- bookkeeping ------------------------------------------------------------------------
    def _lose(self, c: int, error: str) -> None:
        with self._cond:
            if c in self.left or c in self.lost or self._closing:
                return
            self.lost[c] = {"time": time.time(), "error": error, "step": self.steps.get(c, 0),
                            "samples": self.samples.get(c, 0), "clock": self.clocks.get(c, 0),
                            "counted": self.counted.get(c, 0)}
            tell(self.rule, "forget", c)
            self._cond.notify_all()

    def _failed(self, message: str) -> None:
        with self._cond:
            self.errors.append(message.strip().splitlines()[0] if message.strip() else message)
            self._cond.notify_all()

    def _admit(self, c: int) -> None:
        """Wait (holding the shard's condition) until client ``c``'s exchange may go: at
        most ``HOLD`` timeouts, so that a silent worker it waits for is lost first (after
        one timeout) rather than the exchange refused."""
        if not self.admission.waits:
            return
        limit = HOLD * self.timeout
        deadline = time.monotonic() + limit
        while True:
            blockers = self.admission.blockers(c, self.ledger, self._active(c))
            if not blockers:
                return
            left = deadline - time.monotonic()
            if self._closing:
                raise Refused(f"server {self.server} is shutting down")
            if left <= 0:
                raise Refused(f"the exchange of client {c} was held back {limit:g} s by "
                              f"the {self.admission.holding()}, waiting for worker(s) "
                              f"{', '.join(map(str, blockers))}")
            self._cond.wait(min(left, 1.0))

    def _apply(self, c: int, header: Header, payload: torch.Tensor,
               reply: torch.Tensor) -> int:
        """Admit and apply client ``c``'s exchange; returns the version after it."""
        if self.rule is None:
            raise Refused(f"server {self.server} has no update rule: it only serves pulls")
        with self._cond:
            self._admit(c)
            if self.locked:
                self.rule.apply(header, payload, reply)
            version = self.ledger.book(c)
            self.counted[c] = header.samples
            self._cond.notify_all()
        if not self.locked:
            self.rule.apply(header, payload, reply)  # lock free: concurrent with the others
        return version

    # -- serving ----------------------------------------------------------------------------
    def _serve(self, c: int) -> None:
        try:
            ch = PairChannel(self.store, self.server, c, self.timeout,
                             self.connect_timeouts.get(c, self.connect_timeout), fields=self.fields,
                             intra_host=self.intra_host,
                             message=self.center.numel() * self.center.element_size())
        except ChannelError as exc:
            self._lose(c, str(exc))
            return
        session = Session(ch, self.center if c in self.admission.pushers else None)
        try:
            while not self._closing:
                head = session.next_request()
                if head.kind in (Kind.EXCHANGE, Kind.PULL):  # the requests that carry progress
                    with self._cond:
                        self.clocks[c], self.steps[c], self.samples[c] = \
                            head.clock, head.step, head.samples
                if head.kind == Kind.PING:
                    continue
                handler = self._handlers.get(head.kind)
                if handler is None:
                    raise ChannelError(f"{ch.name}: unknown message kind {head.kind}")
                if session.payload is None and head.kind in (Kind.EXCHANGE, Kind.PULL):
                    session.allocate(self.center)
                if handler(c, session, head):
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

    # -- the dispatch table: one handler per kind; True when the client left ----------------
    def _on_exchange(self, c: int, session: Session, head: Header) -> bool:
        payload, reply = session.receive_payload()
        error: str | None = None
        try:
            version = self._apply(c, head, payload, reply)
        except Refused as exc:
            error, version = str(exc), self.version
        except Exception as exc:
            error, version = f"{type(exc).__name__}: {exc}", self.version
            self._failed(f"the update rule failed on client {c}'s exchange: {error}")
        session.reply_with(Kind.EXCHANGE, version, reply, error)
        return False

    def _on_pull(self, c: int, session: Session, head: Header) -> bool:
        reply = session.reply
        assert reply is not None
        with self._cond:
            reply.copy_(self.center)
            if c in self.admission.pushers:  # what the others pull is no gradient's point
                tell(self.rule, "sent", c)
            version = self.ledger.saw(c)
            if c in self.first_pulls and self.first_pulls[c] is None:
                self.first_pulls[c] = reply.clone()  # an added client's state at its join
            self._cond.notify_all()  # a fresher pull can unblock the staleness bound
        session.reply_with(Kind.PULL, version, reply, None)
        return False

    def _on_report(self, c: int, session: Session, head: Header) -> bool:
        obj = from_bytes(session.channel.recv_bytes(head.nbytes))
        error: str | None = None
        if self.on_report is None:
            error = f"server {self.server} takes no reports"
        else:
            try:
                with self._report_lock:
                    self.on_report(c, obj)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                self._failed(f"handling client {c}'s report failed: {error}")
        session.reply_with(Kind.REPORT, self.version, None, error)
        return False

    def _on_state(self, c: int, session: Session, head: Header) -> bool:
        try:
            data = to_bytes(self.state())
        except Exception as exc:
            session.reply_with(Kind.STATE, self.version, None, f"{type(exc).__name__}: {exc}")
            return False
        ch = session.channel
        ch.send([ch.pack(Header(Kind.STATE, c, version=self.version, nbytes=data.numel())), data],
                tags=[TAG_HEAD, TAG_BYTES])
        return False

    def _on_bye(self, c: int, session: Session, head: Header) -> bool:
        with self._cond:
            self.left.add(c)
            tell(self.rule, "forget", c)
            self._cond.notify_all()
        with contextlib.suppress(ChannelError):  # it may be gone already: it left
            session.reply_with(Kind.BYE, self.version, None, None)
        return True
