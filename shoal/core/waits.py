"""Who a rank is waiting for, and whether they will ever come.

Every rank of a job issues the same collectives in the same order, so the n-th collective a
rank issues through its :class:`~shoal.core.comm.Comm` is collective #n on every rank.
:class:`CollectiveLog` counts them and knows which are still in flight, and since when. Each
rank's watchdog publishes the count in its heartbeat (:func:`beat`: the same single store
call as before) and, while this rank waits in collective #n, :class:`Waits` looks at the
others:

- a rank that left the job before collective #n (``Comm.close`` says so in the store with
  its final count, :func:`say_left`) will never come: the job stops at once, naming it;
- a rank whose count is below n has not reached collective #n: from a quarter of the
  timeout on (30 s at most) one line on stderr says whom this rank waits for, again at
  doubling intervals, and shortly before the collective's own timeout the job stops naming
  that rank. A rank that only computes long is not named: it reaches the collective.

At the end of the job (``Comm.close``) a rank waits the same way for the ranks that have not
left yet. The store calls are the watchdog's; besides the heartbeat, a wait makes one call a
second after its first second, and a few per rank when there is something to say.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from shoal.core.failures import LEFT_EARLY

log = logging.getLogger("shoal.waits")

#: A heartbeat counter counts beats below this and carries the collective count above it.
SEQ_UNIT = 1 << 32
#: The count is carried modulo this, so the counter never overflows (ranks are never half
#: of it apart).
SEQ_MOD = 1 << 24
CHECK_AFTER = 1.0  # seconds: a shorter wait is not looked into
FIRST_REPORT = 30.0  # seconds: the first line about a wait, at the latest


def key_prefix(attempt: int) -> str:
    """Where shoal's keys live in the job's store: ``shoal/<attempt>``.

    torchrun restarts a failed job (``--max-restarts``) with the same agent and, possibly, the
    same store; the attempt number (``TORCHELASTIC_RESTART_COUNT``) keeps an old attempt's
    abort report and heartbeats from ending the new attempt.
    """
    return f"shoal/{attempt}"


def generation_key(rank: int) -> str:
    """Where rank ``rank`` says which of its :class:`Keys` its current Comm uses."""
    return f"generation/{rank}"


class Keys:
    """The names of a Comm's keys in the job's store (under :func:`key_prefix`).

    A process may leave the job and join it again (``shoal.shutdown()``, then
    ``shoal.init()``): each Comm made on the job's store is the ``generation``-th of its
    process, and so of every rank, and its heartbeats and departures are its own.
    """

    def __init__(self, generation: int) -> None:
        self.generation = generation
        #: How many ranks left; ``left/<g>/<rank>``: ``"<its collective count> <how>"`` (``?``:
        #: the count is not known); ``left/<g>/all`` is there once every rank left.
        self.left = f"left/{generation}"
        self.all_left = f"left/{generation}/all"
        #: How many ranks stopped their watchdog after every rank left; ``closed/<g>/all``:
        #: all did (the store's host, rank 0 under Slurm or mpirun, may then exit).
        self.closed = f"closed/{generation}"
        self.all_closed = f"closed/{generation}/all"

    def heartbeat(self, rank: int) -> str:
        return f"hb/{self.generation}/{rank}"

    def left_by(self, rank: int) -> str:
        return f"{self.left}/{rank}"


def say_left(store: Any, keys: Keys, rank: int, world_size: int, how: str,
             count: int | None) -> None:
    """Say in the job's ``store`` (under :func:`key_prefix`) that ``rank`` left the job after
    ``count`` collectives (``None``: not known) and ``how``; the last to leave says that all
    did."""
    store.set(keys.left_by(rank), f"{'?' if count is None else count} {how}")
    if store.add(keys.left, 1) >= world_size:
        store.set(keys.all_left, "1")


def say_closed(store: Any, keys: Keys, world_size: int) -> None:
    """Say in the job's ``store`` that this rank, having left, asks the store nothing more
    (its watchdog stopped); the last to say so says that all did."""
    if store.add(keys.closed, 1) >= world_size:
        store.set(keys.all_closed, "1")


def departures(store: Any, keys: Keys, world_size: int, known: dict[int, tuple[int | None, str]],
               call: Callable[..., Any] = lambda fn, *args: fn(*args)
               ) -> dict[int, tuple[int | None, str]]:
    """The ranks that left the job (:func:`say_left`): their collective count (``None``: not
    known) and how they left; ``known`` (those found before) is updated and returned.
    ``call(fn, *args)`` makes the store calls."""
    if call(store.add, keys.left, 0) > len(known):
        for rank in range(world_size):
            key = keys.left_by(rank)
            if rank not in known and call(store.check, [key]):
                count, _, how = call(store.get, key).decode().partition(" ")
                known[rank] = (None if count == "?" else int(count), how)
    return known


def say_gone(store: Any, rank: int, world_size: int, how: str) -> None:
    """For shoal's launcher: say that ``rank``, whose process ended ``how`` without leaving
    the job in order (``os._exit(0)``), left its current Comm, if it has one it did not
    leave: the others need not wait for it at their end."""
    if store.check([generation_key(rank)]):
        keys = Keys(int(store.get(generation_key(rank))))
        if not store.check([keys.left_by(rank)]):
            say_left(store, keys, rank, world_size, how, None)


def ended_key(rank: int) -> str:
    """Where shoal's launcher says how the process of ``rank``, lost to the job, ended."""
    return f"ended/{rank}"


#: Where elastic membership (:mod:`shoal.core.membership`) keeps its keys.
ELASTIC = "elastic"
#: Set once an elastic job's summary is written: it finished (:mod:`shoal.core.keeper`).
DONE_KEY = f"{ELASTIC}/done"


def say_finished(store: Any | None, summary: Any) -> None:
    """Where this process wrote the job's summary (``summary`` not ``None``), say in the
    job's ``store`` that the job finished (:data:`DONE_KEY`: the keepers of an outside
    launcher's ranks wait for it, :mod:`shoal.core.keeper`)."""
    if summary is not None and store is not None:
        store.set(DONE_KEY, "1")


def publish_members(store: Any, generation: str, ranks: list[int]) -> None:
    """Say that the job's latest group, ``generation``, is ``ranks`` (processes the launcher
    ends once all of these finished: those left out, stopped or late); an asynchronous
    job's server 0 says so after a loss (the elastic group's members agree on theirs)."""
    store.set(f"{ELASTIC}/{generation}/members", ",".join(map(str, ranks)))
    store.set(f"{ELASTIC}/latest", generation)


def members_now(store: Any) -> list[int] | None:
    """For the launcher: the ids in the job's latest group, once one was re-formed."""
    if not store.check([f"{ELASTIC}/latest"]):
        return None
    latest = store.get(f"{ELASTIC}/latest").decode()
    return [int(m) for m in store.get(f"{ELASTIC}/{latest}/members").decode().split(",")]


def stood_still(beats: dict[int, tuple[int, float]], member: int, count: int,
                timeout: float) -> bool:
    """Whether ``member``'s heartbeat counter, read now as ``count``, has not moved for
    ``timeout`` seconds; ``beats`` keeps each member's last count and since when (this
    process's clock), updated here."""
    now = time.monotonic()
    seen, since = beats.get(member, (None, now))
    if count != seen:
        beats[member] = (count, now)
        return False
    return now - since > timeout


def beat(count: int, published: int) -> int:
    """What to add to this rank's heartbeat counter to beat once and carry the collective
    count ``count`` instead of ``published``."""
    return 1 + SEQ_UNIT * (count % SEQ_MOD - published % SEQ_MOD)


def count_of(counter: int, near: int) -> int:
    """The collective count a heartbeat counter carries (the one nearest ``near``)."""
    ahead = (counter // SEQ_UNIT - near) % SEQ_MOD
    return near + (ahead - SEQ_MOD if ahead >= SEQ_MOD // 2 else ahead)


def describe(op: str, name: str | None = None) -> str:
    """``all_reduce`` or ``all_reduce (gradients)``: a collective as the lines name it."""
    return f"{op} ({name})" if name else op


def named(op: str, name: str, default: str | None = None) -> str:
    """The collective ``op`` its caller called ``name``, as the lines name it (a name that
    only repeats the op, or is its ``default``, is left out)."""
    return describe(op, None if name in (op, default) else name)


class Pending(NamedTuple):
    seq: int  # its number; at the end of the job, one past the last collective
    what: str
    since: float  # time.monotonic()
    at_end: bool = False


class CollectiveLog:
    """The collectives this rank issued (:attr:`count`), those still in flight, and the one
    this rank's program waits in. Thread-safe: DDP completes collectives on threads of its
    own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self._pending: dict[int, tuple[str, float]] = {}
        self._blocked: list[Pending] = []  # what the program waits in now (the newest last)
        self._finished = (0, time.monotonic())  # the newest finished collective, and when

    def start(self, what: str) -> int:
        """Count a collective that starts now; returns its number, for :meth:`finish`."""
        with self._lock:
            self.count += 1
            self._pending[self.count] = (what, time.monotonic())
            return self.count

    def finish(self, seq: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._pending.pop(seq, None)
            if seq >= self._finished[0]:
                self._finished = (seq, now)

    @contextlib.contextmanager
    def blocked(self, seq: int) -> Iterator[None]:
        """The program waits in collective ``seq`` (started before) while the body runs."""
        with self._lock:
            what, since = self._pending.get(seq, ("a collective", time.monotonic()))
        with self._waiting(Pending(seq, what, since)):
            yield

    @contextlib.contextmanager
    def track(self, what: str) -> Iterator[None]:
        """A collective that starts now and runs while the body does (a blocking call)."""
        seq = self.start(what)
        try:
            with self.blocked(seq):
                yield
        finally:
            self.finish(seq)

    def follow(self, what: str, issue: Callable[[], Any],
               future: Callable[[Any], Any] | None = None) -> Any:
        """``issue()`` an asynchronous collective that nobody here waits for (DDP does), and
        follow it until the future returned completes: ``future(work)``, else the work's."""
        seq = self.start(what)
        try:
            work = issue()
            done = future(work) if future is not None else work.get_future()
        except BaseException:
            self.finish(seq)
            raise
        done.add_done_callback(lambda _: self.finish(seq))
        return done

    def at_end(self) -> contextlib.AbstractContextManager[None]:
        """This rank waits, its work done, for the others to finish theirs."""
        return self._waiting(Pending(self.count + 1, "the end", time.monotonic(), True))

    @contextlib.contextmanager
    def _waiting(self, pending: Pending) -> Iterator[None]:
        with self._lock:
            self._blocked.append(pending)
        try:
            yield
        finally:
            with self._lock:
                self._blocked.remove(pending)

    def current(self) -> Pending | None:
        """The wait that matters now: what this rank's program waits in, else its oldest
        collective in flight (a DDP bucket, an all-reduce not waited for yet), if any."""
        with self._lock:
            if self._blocked:
                return self._blocked[-1]
            if self._pending:
                seq = min(self._pending)
                return Pending(seq, *self._pending[seq])
        return None

    def finished_at(self, seq: int) -> float | None:
        """When collective ``seq`` finished here, if it is the newest that did."""
        with self._lock:
            newest, at = self._finished
        return at if newest == seq else None


class Waits:
    """What the watchdog thread makes of this rank's wait (see the module's docstring).

    ``log`` holds this rank's collectives, ``keys`` name its Comm's keys, ``timeout`` is the
    collectives' (``None``: none known, the job is never stopped for a wait).
    """

    def __init__(self, rank: int, world_size: int, log: CollectiveLog, keys: Keys,
                 timeout: float | None) -> None:
        self._rank, self._world, self.log, self.keys = rank, world_size, log, keys
        self._timeout = timeout
        self._first = FIRST_REPORT if timeout is None else min(FIRST_REPORT, timeout / 4)
        # Before the collective's own timeout fires (its error would only say "timed out").
        self._deadline = None if timeout is None else timeout - min(1.5, timeout / 4)
        self._departed: dict[int, tuple[int | None, str]] = {}
        self._watching: Pending | None = None
        self._origin = self._next = 0.0

    def resumed(self) -> None:
        """This process did not run for a while (the whole job was stopped): a wait counts
        from now on, as nobody could come meanwhile."""
        self._origin, self._next = time.monotonic(), self._first

    def look(self, store: Any, call: Callable[..., Any]) -> tuple[int, str] | None:
        """Look at this rank's wait; returns ``(rank, why)`` when the job must stop because
        of ``rank``, after printing what is worth saying. ``call(fn, *args)`` makes the
        store calls (the watchdog's, timed by its guard)."""
        pending = self.log.current()
        if pending != self._watching:
            self._watching = pending
            self._origin, self._next = (pending.since if pending else 0.0), self._first
        if pending is None:
            return None
        waited = time.monotonic() - self._origin
        if waited < CHECK_AFTER:
            return None
        departed = self._departures(store, call)
        if not pending.at_end:
            for rank, (count, how) in sorted(departed.items()):
                # An unknown count (os._exit(0)): its process is gone, so the collective
                # fails by itself, and the launcher names it.
                if count is not None and count < pending.seq:
                    return rank, LEFT_EARLY.format(how=how)
        late = self._deadline is not None and waited >= self._deadline
        if waited < self._next and not late:
            return None
        missing = self._missing(store, call, pending, departed)
        if not missing:  # every rank is in it (or past it): slow, not missing
            self._next *= 2
            return None
        rank, count = missing[0]
        if late:
            what = "never finished" if pending.at_end else f"never joined {pending.what} #{pending.seq}"
            return rank, (f"{what}: rank {self._rank} waited {int(waited)} s for it (the timeout "
                          f"is {self._timeout:g} s; {self._seen(count)})")
        where = "at the end of the job" if pending.at_end else f"in {pending.what} #{pending.seq}"
        log.warning(f"shoal: rank {self._rank} has waited {int(self._next)} s {where} for "
                    f"{_ranks([r for r, _ in missing])} ({self._seen(count)})")
        self._next *= 2
        return None

    def _departures(self, store: Any, call: Callable[..., Any]
                    ) -> dict[int, tuple[int | None, str]]:
        """The ranks that left the job: their collective count and how they left."""
        return departures(store, self.keys, self._world, self._departed, call)

    def _missing(self, store: Any, call: Callable[..., Any], pending: Pending,
                 departed: dict[int, Any]) -> list[tuple[int, int]]:
        """The ranks that have not reached ``pending`` (at the end: that have not left),
        with their collective counts."""
        found = []
        for rank in range(self._world):
            if rank == self._rank or (pending.at_end and rank in departed):
                continue
            count = count_of(call(store.add, self.keys.heartbeat(rank), 0), pending.seq)
            if count < pending.seq:
                found.append((rank, count))
        return found

    def _seen(self, count: int) -> str:
        # Only collectives through shoal are counted: a rank may well be in one of its own
        # torch.distributed calls, which shoal does not see.
        if count <= 0:
            return "not seen in any collective through shoal yet"
        at = self.log.finished_at(count)
        ago = "" if at is None else f", {int(time.monotonic() - at)} s ago"
        return f"last seen in collective #{count}{ago}"


def _ranks(ranks: list[int], shown: int = 8) -> str:
    """``rank 3``, ``ranks 1, 2`` or ``ranks 1, ..., 8 and 5 more``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return "ranks " + ", ".join(str(r) for r in ranks[:shown]) + more
