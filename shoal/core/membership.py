"""Elastic membership (``--elastic``): the workers alive go on when one dies or stops answering.

Every collective a :class:`~shoal.core.comm.Comm` issues is a *meeting*. Under elastic
membership each meeting ends with a vote in the job's store (:meth:`Membership.meet`): every
member says whether its collective succeeded, and one decision key, written once
(``compare_set``), says whether the meeting counts. A member that died never votes: the
launcher says it ended (:func:`~shoal.core.waits.ended_key`), or its heartbeat (the watchdog's) stops; the
others then decide that the meeting failed. So every member alive takes the same view of
every meeting, even when a collective finished on some and failed on others.

After a failed meeting the members alive agree on who is left (:meth:`Membership._reform`:
each announces itself for the next *membership epoch*, one ``compare_set`` fixes the list)
and join a new process group for that epoch over the same store (its own key prefix), with
new ranks in the order of the members' ids (each worker keeps the id it started with).
Then the meeting is held again from its inputs (``restore``), or, where it cannot be (DDP's
all-reduce inside backward), :class:`MembershipChanged` tells the caller to redo its step.
Listeners (the trainer) hear of every change first: the lost members' unfinished work is
theirs to hand out.

This is torchft's quorum and commit vote in shoal's terms (a quorum per membership epoch, a
``should_commit`` per meeting), on torch.distributed's own store and process groups.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shoal.core.group import join_group, own_client
from shoal.core.inflight import InFlight, leave_group
from shoal.core.stop import stop_requested
from shoal.core.waits import ELASTIC, ended_key, stood_still
from shoal.errors import ShoalError

log = logging.getLogger("shoal.membership")

_T = TypeVar("_T")
POLL = 0.02  # seconds between two looks at the store while a member is awaited
#: A vote for a meeting counts 1, plus this when its member was asked to stop (SIGTERM).
STOP = 1 << 20
#: Seconds a vote waits in the store's own wait (woken at once when the last member votes)
#: before it looks for lost members itself: only a member lost after its collective
#: succeeded, which shoal's launcher does not report (another launcher's, or a stopped one),
#: is noticed this late (:meth:`InFlight.vote` decides at once on the launcher's word).
WAKE = 1.0
#: A meeting that fails although every member is alive, other than by a timeout (a slow
#: member), is held again this many times; then its error is raised (it is the program's,
#: not a lost member's).
MAX_RETRIES = 3
Listener = Callable[[list[int], list[int]], None]


class MembershipChanged(Exception):
    """A meeting failed and the group was re-formed; the caller redoes its step. ``lost``:
    the ids of the members that left."""

    def __init__(self, lost: list[int]) -> None:
        super().__init__(f"the workers {lost} left; the group was re-formed")
        self.lost = lost


class Membership:
    """This worker's view of who is in the job (see the module's docstring).

    ``store``: the job's store under :func:`~shoal.core.waits.key_prefix`; ``me``: this
    worker's id (its first rank); ``heartbeat(id)``: the key of that worker's heartbeat
    counter; ``timeout``: the collectives' timeout in a re-formed group, and how long a
    heartbeat may stand still before its worker counts as gone; ``patience``: the longest
    wait for a member that still beats.
    """

    def __init__(self, store: Any, me: int, world: int, heartbeat: Callable[[int], str] | None,
                 timeout: float, patience: float, device_type: str,
                 connect: Callable[[], Any] | None = None, *, scope: str = ELASTIC,
                 members: list[int] | None = None,
                 ended: Callable[[int], str] = ended_key) -> None:
        self._raw, self.scope, self._ended = store, scope, ended
        self._store = dist.PrefixStore(scope, store)
        #: Collectives in flight, failed early when their meeting is decided failed; its
        #: thread reads the store through ``connect()`` (a client of its own), else ``store``.
        self.inflight = InFlight(connect or (lambda: store), scope)
        self.me, self.members = me, list(range(world)) if members is None else list(members)
        self._heartbeat, self.timeout, self.patience = heartbeat, timeout, patience
        self._device_type = device_type
        self.epoch = 0  # the membership epoch: one per group
        self._seq = 0  # meetings held in this epoch
        self._beats: dict[int, tuple[int, float]] = {}  # a member's counter, when it moved
        self._beats_lock = threading.Lock()  # the poll thread looks too (observe)
        self.inflight.observe = self._observe
        #: Whether a member was asked to stop (SIGTERM) when it voted on the last meeting:
        #: every member's stop vote, with no collective of its own.
        self.stop_voted = False
        self.listeners: list[Listener] = []
        #: Joining (:mod:`shoal.core.admission`): the job's first size (ids from it on are
        #: joiners'), whether a meeting's decision said a worker asks to join, the requests
        #: answered so far (the same on every member), the ids that joined at the last change.
        self.first_world, self.join_asked, self.joins_handled = world, False, 0
        self.join_rounds = 0  # admission rounds held (:func:`~shoal.core.admission.admit`)
        self.joined: list[int] = []
        self.seal: Any = None  # the job's join secret (shoal.core.trust.Seal), on worker 0

    @classmethod
    def of(cls, comm: Any, store: Any, heartbeat_timeout: float | None,
           timeout: float | None, attempt: int = 0) -> Membership:
        """``comm``'s membership (``store``: the job's under its key prefix), which keeps
        its rank and world size those of the group after every change."""
        return cls(store, comm.rank, comm.world_size, comm._keys.heartbeat,
                   heartbeat_timeout or 10.0, timeout or 300.0, comm.device.type,
                   connect=lambda: own_client(comm.store, attempt))._followed_by(comm)

    @classmethod
    def of_group(cls, comm: Any, store: Any, members: list[int], me: int,
                 gone: Callable[[int], str], timeout: float, patience: float,
                 connect: Callable[[], Any]) -> Membership:
        """The membership of a group inside a job (a compute group: ``comm`` its Comm,
        ``members`` the job's ids of its workers, ``me`` this one's), with keys of its own
        in ``store``. Who is gone is not judged here: a member is once ``gone(id)`` is in
        the store (the job's judge, server 0, says so)."""
        return cls(store, me, len(members), None, timeout, patience, comm.device.type, connect,
                   scope=f"{ELASTIC}/group/{members[0]}", members=members,
                   ended=gone)._followed_by(comm)

    def _followed_by(self, comm: Any) -> Membership:
        """Keep ``comm``'s rank and world size those of the group after every change."""

        def regrouped(lost: list[int], ranks: list[int]) -> None:
            comm.rank, comm.world_size = self.rank, self.world_size

        self.listeners.append(regrouped)
        return self

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def world_size(self) -> int:
        return len(self.members)

    # -- meetings ------------------------------------------------------------------------------
    def meet(self, run: Callable[[], _T], keep: torch.Tensor | None = None) -> _T:
        """``run()`` a collective and agree with the others that it succeeded; after a failed
        meeting re-form the group, put ``keep`` (the collective's input, changed in place)
        back as it was and hold it again. A collective ``run`` starts with ``async_op=True``
        is waited for here, and left as soon as another member says the meeting failed."""
        kept = keep.clone() if keep is not None else None
        retries = 0
        while True:
            error: Exception | None = None
            try:
                result = run()
                if isinstance(result, dist.Work):
                    result = self.inflight.wait(result, self.decision)
            except RuntimeError as exc:  # Gloo: a peer closed its connection, or timed out
                error, result = exc, None
            if self._agree(error is None):
                return result  # type: ignore[return-value]
            lost = self._reform()
            slow = error is not None and "timed out" in str(error).lower()
            retries = 0 if lost or slow else retries + 1
            if retries >= MAX_RETRIES:
                if error is not None:
                    raise error
                raise ShoalError(f"a collective failed {MAX_RETRIES} times with every worker alive")
            if keep is not None:
                keep.copy_(kept)

    @contextlib.contextmanager
    def voted(self) -> Iterator[None]:
        """A collective run by the body (DDP's all-reduce inside backward), voted on after
        it. Held again it cannot be: a failed one re-forms the group and raises
        :class:`MembershipChanged`, for the caller to redo its step."""
        error: RuntimeError | None = None
        try:
            yield
        except RuntimeError as exc:  # a peer lost
            error = exc
        if not self._agree(error is None):
            lost = self._reform()
            if not lost and error is not None and "timed out" not in str(error).lower():
                raise error  # every member alive: the program's error, not a lost member's
            raise MembershipChanged(lost)

    @property
    def decision(self) -> str:
        """The key of the decision on the meeting in flight."""
        return f"{self.epoch}/{self._seq}/decision"

    def watched(self, work: Any) -> torch.futures.Future:
        """The future of ``work`` (a collective's, e.g. DDP's bucket), failed early when its
        meeting is decided failed."""
        return self.inflight.watch(work, self.decision)

    def _agree(self, ok: bool) -> bool:
        """Whether meeting ``seq`` of this epoch counts: all members said it succeeded. The
        last to say so, or the first to see it failed, writes the decision (once)."""
        base = f"{self.epoch}/{self._seq}"
        self._seq += 1
        decision = f"{base}/decision"
        if not ok:
            self._store.compare_set(decision, "", "abort")
            return False
        total = self._store.add(f"{base}/ok", 1 + (STOP if stop_requested() else 0))
        if total % STOP >= len(self.members):
            verdict = self._store.compare_set(decision, "", "commit" + ("+stop" if total >= STOP
                                              else "") + ("+join" if self._asked() else ""))
        else:
            with self.inflight.vote(decision, [self._ended(m) for m in self.members if m != self.me]):
                while not self._wait(decision, 4 * POLL, first=WAKE):
                    if any(self._gone(m) for m in self.members):  # it will never say so
                        self._store.compare_set(decision, "", "abort")
            verdict = self._store.get(decision)
        parts = verdict.decode().split("+")
        counts = parts[0] == "commit"
        self.stop_voted = counts and "stop" in parts
        self.join_asked = self.join_asked or (counts and "join" in parts)
        if counts and self.rank == 0 and self._seq > 1:
            self._forget(f"{self.epoch}/{self._seq - 2}")
        return counts

    def look_for_joiners(self) -> None:
        """A member alone holds no meeting, whose vote would tell it of a join request:
        it looks at the meeting points itself."""
        self.join_asked = self.join_asked or self._asked()

    def _asked(self) -> bool:
        """Whether a worker asked to join since the requests last answered."""
        return self._store.add("join/asked", 0) > self.joins_handled

    @property
    def keys(self) -> Any:
        """The job's store under the elastic prefix (where joining keeps its keys too)."""
        return self._store

    def _forget(self, base: str) -> None:
        """Delete a meeting's keys once every member is past it (all voted on the next),
        so that the store does not grow with the steps."""
        self._store.delete_key(f"{base}/decision")
        self._store.delete_key(f"{base}/ok")

    # -- re-forming ----------------------------------------------------------------------------
    def _reform(self) -> list[int]:
        """Agree on the members alive, join their new group; returns the ids that left."""
        before = list(self.members)
        while True:
            old, nxt = list(self.members), self.epoch + 1
            here = f"{nxt}/here"
            self._store.set(f"{here}/{self.me}", "1")
            started = time.monotonic()
            while time.monotonic() - started < self.patience:
                waiting = [m for m in old if not self._store.check([f"{here}/{m}"])]
                if all(self._gone(m) for m in waiting):
                    break
                time.sleep(POLL)
            alive = [m for m in old if self._store.check([f"{here}/{m}"])]
            agreed = self._store.compare_set(f"{nxt}/members", "", ",".join(map(str, alive)))
            members = [int(m) for m in agreed.decode().split(",")]
            if self.me not in members:  # it did not answer in time: lost, as if killed
                log.error(f"shoal: worker {self.me} was left out of the job's group (it did not "
                          "answer in time); it stops")
                os.kill(os.getpid(), signal.SIGKILL)
            if self.enter(nxt, members):
                break
        lost = [m for m in before if m not in members]
        self.joined = []
        for listener in self.listeners:
            listener(lost, [before.index(m) for m in lost])
        return lost

    def enter(self, epoch: int, members: list[int]) -> bool:
        """Make ``members`` (their ids, in rank order) the group of membership epoch
        ``epoch`` and join its process group; False when a member did not come."""
        self._store.set("latest", str(epoch))
        self.epoch, self.members, self._seq = epoch, members, 0
        return self._join()

    def grow(self, epoch: int, members: list[int], joined: list[int]) -> list[int]:
        """The members and the workers ``joined`` (admitted by :mod:`shoal.core.admission`)
        form the group of ``epoch``; listeners hear of it as of a change that lost no one.
        Where one does not come (a member lost meanwhile, a joiner lost), the group is
        agreed again among those alive, the joiners there with the rest (listeners hear of
        the loss). Returns the ids that joined; a joiner calls it too."""
        if not self.enter(epoch, members):
            self._reform()
            self.joined = [j for j in joined if j in self.members]
            return self.joined
        self.joined = list(joined)
        for listener in self.listeners:
            listener([], [])
        return self.joined

    def _join(self) -> bool:
        """Leave the old process group and join this epoch's; False when a member did not
        come (the members are then agreed again)."""
        leave_group(self.inflight)
        if len(self.members) == 1:
            return True
        try:
            join_group(dist.PrefixStore(f"{self.scope}/{self.epoch}/group", self._raw), self.rank,
                       len(self.members), self._device_type, self.timeout)
        except ShoalError:
            return False
        return True

    def lost_unseen(self) -> bool:
        """Whether shoal's launcher says a member's process ended (the members have not
        re-formed the group without it yet)."""
        return any(self._raw.check([self._ended(m)]) for m in self.members if m != self.me)

    def reason(self, member: int) -> str:
        """Why ``member`` left, as far as the store knows."""
        if self._raw.check([self._ended(member)]):
            return f"worker {member} {self._raw.get(self._ended(member)).decode()}"
        return f"worker {member} stopped answering (no heartbeat for {self.timeout:g} s)"

    # -- who is alive --------------------------------------------------------------------------
    def _gone(self, member: int) -> bool:
        """Whether ``member`` ended (its launcher said so) or its heartbeat stood still for
        ``timeout`` seconds."""
        if member == self.me:
            return False
        if self._raw.check([self._ended(member)]):
            return True
        return self._heartbeat is not None and self._stood_still(self._raw, member)

    def _stood_still(self, store: Any, member: int) -> bool:
        """Whether ``member``'s heartbeat counter, read through ``store`` (a client of the
        calling thread's), has not moved for ``timeout`` seconds of this process's looks."""
        assert self._heartbeat is not None
        count = store.add(self._heartbeat(member), 0)
        with self._beats_lock:
            return stood_still(self._beats, member, count, self.timeout)

    def _observe(self, store: Any) -> None:
        """The members' heartbeats, looked at on the in-flight poll thread (its ``store``
        client) while a meeting is slow: the first look at a stopped member's counter would
        otherwise come only once its collective timed out, and its verdict a timeout later."""
        for member in list(self.members) if self._heartbeat is not None else []:
            if member != self.me:
                self._stood_still(store, member)

    def _wait(self, key: str, seconds: float, first: float = 0.0) -> bool:
        """Whether ``key`` is in the store within ``seconds``: the store's own wait for the
        ``first`` seconds (it wakes at once), then polled (a wait that times out logs a
        warning each time)."""
        if first:
            try:
                self._store.wait([key], timedelta(seconds=first))
                return True
            except RuntimeError:  # DistStoreError: not there yet (a member may be lost)
                pass
        deadline, pause = time.monotonic() + seconds, 0.0005
        while not self._store.check([key]):
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, POLL / 4)
        return True
