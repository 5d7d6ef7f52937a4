"""Leaving a failed meeting at once, not at the collective's timeout (``--elastic``).

When a worker dies in the middle of a collective, its ring neighbours see their connection
close and vote the meeting failed at once (:mod:`shoal.core.membership`). A member that is
not its neighbour keeps waiting in Gloo for data that never comes, until the process
group's timeout: its live peers hold their connections open while they wait for it in the
next vote, and DDP holds the group, so nothing closes them. :class:`InFlight` ends that
wait from the store instead, as torchft's Manager does: the member waits on a future of
shoal's own, which a poll thread fails as soon as the meeting's decision key says
``abort``.

A collective left that way still runs out in Gloo's thread (until its peers close their
old group, at the latest its timeout). Nothing of Python is attached to it: a *waiter*
thread waits for each collective in short slices and settles shoal's future; a waiter
left behind by a failed meeting is retired and a fresh one serves the next. (A Python
callback on Gloo's future runs on Gloo's thread, and a Python thread blocked in a
collective's wait resumes, when the interpreter has ended at the latest: both crash the
process in ``std::terminate``; :meth:`InFlight.stop` ends the retired waiters first.) The
group of a member that left a collective is kept (:func:`leave_group`), not destroyed
under it: destroying it joins Gloo's thread, which sits in that collective.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.group import DEFAULT_SOCKETS
from shoal.core.sockets import cut

log = logging.getLogger("shoal.membership")
POLL = 0.02  # seconds between two looks at the decisions of the meetings waited on
SLICE = timedelta(milliseconds=100)  # a waiter's longest wait before it looks up again
ABANDONED = "the meeting was voted failed by another worker"
#: Process groups with a collective this process left, kept until it is over.
_BURIED: list[tuple[Any, list[Any]]] = []
#: Seconds a group left is waited on to end its collectives once its connections are cut.
CUT_WAIT = 2.0
SLICED = "Operation timed out"  # how a wait's slice ends (Work.wait)
#: Seconds a meeting is waited on before the poll thread looks at the members' heartbeats
#: too (:attr:`InFlight.observe`), and between two such looks.
SLOW = 1.0
RETRY = 0.5  # seconds before the poll thread looks again after a store call failed
_NO_DECISION = "?"  # never a meeting's decision (see InFlight._aborted)
#: decision key, shoal's future, Gloo's work, when it was started (this process's clock)
_Entry = tuple[str, torch.futures.Future, Any, float]


class FutureWork:
    """A future (a chain of collectives, e.g. PowerSGD's hook's) as the work of one
    collective: what :meth:`InFlight.watch` waits on in slices, so that its wait is left as
    soon as the meeting is voted failed (a hung peer holds such a chain until Gloo's own
    timeout otherwise)."""

    def __init__(self, future: torch.futures.Future) -> None:
        self._future = future
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: timedelta) -> bool:
        """Wait up to ``timeout``; raise as ``Work.wait`` does when it passes, or the
        future's own error."""
        if not self._done.wait(timeout.total_seconds()):
            raise RuntimeError(f"{SLICED} waiting for a chain of collectives")
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the chain has ended (as ``Work.is_completed``: a member lost while it ran
        leaves it behind, and the group's clean-up asks this of every collective left)."""
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future:
        return self._future


class InFlight:
    """This member's collectives in flight, each watched against its meeting's decision.

    ``connect()`` gives the store client the poll thread reads (the attempt's keys; a client
    of its own, so that it never queues behind the main thread's calls); the decisions are
    under ``prefix`` in it. ``observe(store)``, when set, is called on the poll thread with
    that client every :data:`SLOW` seconds while a meeting has been waited on for as long
    (the members' heartbeats: a member that stopped is then known gone one heartbeat
    timeout after it stopped, not only after the collective's timeout and another).
    """

    def __init__(self, connect: Callable[[], Any], prefix: str) -> None:
        self._connect, self._prefix, self._store, self._keys = connect, prefix, None, None
        #: a vote waited on: the others' ended keys, since when
        self._votes: dict[str, tuple[list[str], float]] = {}
        self.observe: Callable[[Any], None] | None = None
        self._observed = 0.0  # when observe() was last called
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._watched: list[_Entry] = []  # not settled yet
        self._queue: queue.SimpleQueue | None = None  # the current waiter's
        self._waiter: threading.Thread | None = None
        self._poller: threading.Thread | None = None
        #: Collectives left behind by a failed meeting (see :func:`leave_group`).
        self.left: list[Any] = []
        self._retired: list[threading.Thread] = []  # waiters that may wait in one of them

    def watch(self, work: Any, decision: str) -> torch.futures.Future:
        """A future with the value (or error) of ``work`` (a ``dist`` collective started with
        ``async_op=True``), failed early when the store's key ``decision`` says ``abort``."""
        entry = (decision, torch.futures.Future(), work, time.monotonic())
        with self._lock:
            self._watched.append(entry)
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                self._waiter = threading.Thread(target=self._wait_each, args=(self._queue,),
                                                daemon=True, name="shoal-inflight-wait")
                self._waiter.start()
            self._queue.put(entry)
        self._start_polling()
        return entry[1]

    @contextlib.contextmanager
    def vote(self, decision: str, ended: list[str]) -> Iterator[None]:
        """While the body waits for ``decision``, write it ``abort`` as soon as one of the
        keys ``ended`` is there (shoal's launcher says a member's process ended): a member
        lost after its collective succeeded never votes, and the others would wait for it
        a while before they look (:data:`~shoal.core.membership.WAKE`)."""
        with self._lock:
            self._votes[decision] = (ended, time.monotonic())
        self._start_polling()
        try:
            yield
        finally:
            with self._lock:
                del self._votes[decision]

    def _start_polling(self) -> None:
        with self._lock:
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, daemon=True,
                                                name="shoal-inflight-poll")
                self._poller.start()
        self._wake.set()

    def wait(self, work: Any, decision: str) -> Any:
        """Wait for ``work``, or raise ``RuntimeError`` once its meeting is decided failed.

        The error raised is a fresh one: the future's own, raised again in it, would take a
        traceback through the future's frame, a cycle through torch's future that Python's
        collector cannot see, which would keep the work and its group's connections for
        good."""
        try:
            return self.watch(work, decision).wait()
        except RuntimeError as exc:
            raise _fresh(exc.with_traceback(None)) from None  # no local holds it: no cycle

    def _wait_each(self, mine: queue.SimpleQueue) -> None:
        """The waiter: settle each collective's future in turn, until retired."""
        while True:
            entry = mine.get()
            value, error = self._finish(entry[2], mine)
            with self._lock:
                if mine is not self._queue:
                    return  # retired: its meeting failed, a fresh waiter serves the next
                self._watched.remove(entry)
            if error is None:
                entry[1].set_result(value)
            else:  # without the traceback, which holds this thread's frame and the work
                entry[1].set_exception(error.with_traceback(None))
            # Not held while it waits for the next: the work holds its group's connections.
            del entry, value, error

    def _finish(self, work: Any, mine: queue.SimpleQueue) -> tuple[Any, Exception | None]:
        """``work``'s result or error; ``(None, None)`` once ``mine``'s waiter is retired
        and this process stops."""
        while True:
            try:
                work.wait(SLICE)
                return work.get_future().value(), None
            except RuntimeError as exc:
                if not str(exc).startswith(SLICED):
                    return None, exc  # Gloo's error, handed on as it came
            if self._stop.is_set() and mine is not self._queue:
                return None, None

    def stop(self, timeout: float) -> None:
        """Stop the poll thread (a store call cut off by the interpreter's end would end
        the process in ``std::terminate``) and the retired waiters (each within a slice;
        their collectives stay with their groups, :func:`leave_group`)."""
        self._stop.set()
        self._wake.set()
        if self._poller is not None:
            self._poller.join(timeout)
        for waiter in self._retired:
            waiter.join(timeout)

    def _poll(self) -> None:
        """:meth:`_watch` until stopped. A store call that fails does not end the watch: a
        watch ended by one error would leave this member waiting out the collective's
        timeout at the next lost member. Where the job's store is gone, the watchdog ends
        this process (a traceback here would only garble the line that says so)."""
        while not self._stop.is_set():
            try:
                self._watch()
            except (RuntimeError, OSError) as exc:  # torch's store errors are RuntimeErrors
                log.debug("shoal: a look of the in-flight watch failed (%s)", exc)
                self._stop.wait(RETRY)

    def _watch(self) -> None:
        """Fail the futures of every meeting decided ``abort`` while waited on; decide a
        vote waited on ``abort`` once a member's process ended."""
        while not self._stop.is_set():
            self._wake.wait()
            with self._lock:
                keys = {key for key, _, _, _ in self._watched}
                votes = dict(self._votes)
                if not keys and not votes:
                    self._wake.clear()
                    continue
                since = min([e[3] for e in self._watched] + [t for _, t in votes.values()])
            if self._store is None:
                self._store = self._connect()
                self._keys = dist.PrefixStore(self._prefix, self._store)
            for decision, (ended, _) in votes.items():
                if any(self._store.check([key]) for key in ended):
                    self._keys.compare_set(decision, "", "abort")
            now = time.monotonic()
            if self.observe is not None and now - since >= SLOW and now - self._observed >= SLOW:
                self._observed = now
                self.observe(self._store)
            failed = {key for key in keys if self._aborted(key)}
            if failed:
                self._fail(failed)
            time.sleep(POLL)

    def _fail(self, keys: set[str]) -> None:
        with self._lock:
            entries = [entry for entry in self._watched if entry[0] in keys]
            for entry in entries:
                self._watched.remove(entry)
            if self._queue is not None:  # retire the waiter: it may wait in one of them
                self._queue = None
                self._retired.append(self._waiter)
            self.left += [source for _, _, source, _ in entries]
        for _, ours, _, _ in entries:
            ours.set_exception(RuntimeError(ABANDONED))

    def _aborted(self, key: str) -> bool:
        """Whether the meeting's decision is ``abort``, read without waiting: a decision
        deleted after a check (every member is past the meeting) would hold a get for the
        client's timeout. A compare-and-set that never matches answers the value, or the
        probe where there is none."""
        return bytes(self._keys.compare_set(key, _NO_DECISION, _NO_DECISION)) == b"abort"


def leave_group(inflight: InFlight) -> None:
    """Leave the default process group: destroyed. Where this process left a collective in
    it, the group's connections (as :func:`~shoal.core.group.join_group` opened them) are
    shut down first, which ends that collective here and at its peers; one not over within
    :data:`CUT_WAIT` keeps the group until it is (:func:`prune`)."""
    prune()
    if not dist.is_initialized():
        return
    left = [w for w in inflight.left if not w.is_completed()]
    inflight.left.clear()
    if cut(DEFAULT_SOCKETS) and left:
        ends = time.monotonic() + CUT_WAIT
        while time.monotonic() < ends and not all(w.is_completed() for w in left):
            time.sleep(POLL)
        left = [w for w in left if not w.is_completed()]
    DEFAULT_SOCKETS.clear()
    if left:
        _BURIED.append((dist.group.WORLD, left))
    dist.destroy_process_group()


def prune() -> None:
    """Let go of the groups kept for a collective left in them that is over now: each
    is freed with its connections and Gloo's threads (a group kept has a thread that may
    spin on data nobody will read)."""
    _BURIED[:] = [(group, left) for group, left in _BURIED
                  if not all(w.is_completed() for w in left)]


def all_objects(m: Any, obj: Any) -> list[Any]:
    """Every member's picklable ``obj``, in rank order, through two all-gathers (sizes,
    then the padded pickles) that are left as soon as the meeting of ``m`` (a
    :class:`~shoal.core.membership.Membership`) is voted failed: torch's object collectives
    wait in Gloo until their timeout."""
    mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.zeros(m.world_size, 1, dtype=torch.int64)
    m.inflight.wait(dist.all_gather(list(sizes), torch.tensor([mine.numel()]), async_op=True),
                    m.decision)
    width = int(sizes.max())
    rows = torch.zeros(m.world_size, width, dtype=torch.uint8)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    m.inflight.wait(dist.all_gather(list(rows), padded, async_op=True), m.decision)
    sizes = sizes.flatten()
    return [pickle.loads(rows[r, :int(n)].numpy().tobytes()) for r, n in enumerate(sizes)]


def _fresh(exc: RuntimeError) -> RuntimeError:
    """An error of ``exc``'s type and message (Gloo's ``DistBackendError`` stays one)."""
    try:
        return type(exc)(str(exc))
    except Exception:
        return RuntimeError(str(exc))
