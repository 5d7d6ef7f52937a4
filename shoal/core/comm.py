"""Timed, byte-counted collectives: the :class:`Comm` every strategy talks through
(:func:`~shoal.core.connect.init_comm` joins a job and returns it).

Every rank of a job of several processes also runs a :class:`~shoal.core.watchdog.Watchdog`
on the job's store: a failing or hung rank ends the job within seconds.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shoal.core.env import Environment
from shoal.core.failures import EXIT_ABORTED, LEFT_EARLY, record_for
from shoal.core.group import hang_up, join_group
from shoal.core.handle import Handle
from shoal.core.inflight import FutureWork
from shoal.core.intrahost import HostPath
from shoal.core.membership import Membership
from shoal.core.objects import ObjectCollectives
from shoal.core.ops import reduce_op
from shoal.core.pairs import Client
from shoal.core.timeline import COMM, WAIT, Event, Timeline
from shoal.core.waits import (
    CollectiveLog,
    Keys,
    Waits,
    departures,
    describe,
    ended_key,
    generation_key,
    key_prefix,
    named,
    say_closed,
    say_left,
)
from shoal.core.watchdog import ABORT_KEY, Watchdog
from shoal.errors import ShoalError

_T = TypeVar("_T")

class Comm(ObjectCollectives):
    """This process's view of the job: rank, world size, device and timed collectives.

    With ``world_size == 1`` and no process group every collective returns its input, so
    strategies need no special case for a single process. With more ranks and a ``store``
    (the job's rendezvous store), a :class:`~shoal.core.watchdog.Watchdog` ends this process
    when another rank fails or stops responding; ``heartbeat_timeout`` (seconds, ``None``:
    never) is how long a rank may go without a heartbeat before it is reported as hung.
    Every collective is counted in :attr:`log`, so that a long wait names the ranks that did
    not come (:mod:`shoal.core.waits`); ``timeout`` is the collectives' own (the process
    group's), which the watchdog ends such a wait just before.

    ``peers=False``: a rank of a job without a process group of all its ranks (an
    asynchronous job's worker or server, whose peers are the parameter servers only: ``ps``):
    no collective goes anywhere and no watchdog runs (a lost worker is no failure of the
    others), even once this process joins a process group of its own (a compute group's,
    spoken for by :attr:`subgroup`). :attr:`store` is the job's store all the same.
    ``elastic``: the job goes on without a lost worker (:mod:`shoal.core.membership`).
    """

    def __init__(
        self,
        env: Environment,
        device: torch.device,
        timeline: Timeline | None = None,
        store: dist.Store | None = None,
        heartbeat_timeout: float | None = 10.0,
        *,
        peers: bool = True,
        timeout: float | None = None,
        elastic: bool = False,
    ) -> None:
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        self.device = device
        self.timeline = timeline or Timeline()
        self.bytes_sent = 0  # payload handed to collectives by this rank during training
        self.in_flight = 0  # payload bytes of this rank's collectives started, not yet waited for
        self.peak_in_flight = 0  # the most there ever were
        #: The job's store (``None``: a process alone), as its launcher serves it.
        self.store = store
        self._store = dist.PrefixStore(key_prefix(env.attempt), store) if store is not None else None
        self._rank0_hosts = not env.agent_store  # the store (as job_store makes it)
        self._error_dir = env.error_dir
        self.aborted = False  # this rank called abort(): nobody will wait for it at close()
        self.ps: Client | None = None  #: an asynchronous job's worker: its end of the servers
        #: The Comm of the group this process computes with inside a job without a process
        #: group of all its ranks (:meth:`join_subgroup`); ``None``: no such group.
        self.subgroup: Comm | None = None
        self.peers = peers
        self._parent: Comm | None = None  # a child's bytes are its parent's too
        self.log = CollectiveLog()  # the collectives this rank issued, for the watchdog
        self._keys = Keys(0)
        self._watchdog: Watchdog | None = None
        self.membership: Membership | None = None
        self.host: HostPath | None = None  #: sums through the host's memory (core.hostpath)
        if self._store is not None and (self.world_size > 1 or elastic) and peers:
            self._watch(env, heartbeat_timeout, timeout, elastic)

    def _watch(self, env: Environment, heartbeat_timeout: float | None, timeout: float | None,
               elastic: bool) -> None:
        """Beat and watch in the job's store (the watchdog); elastic: vote on meetings."""
        self._keys = Keys(next(_GENERATIONS))
        self._store.set(generation_key(self.rank), str(self._keys.generation))
        waits = Waits(self.rank, self.world_size, self.log, self._keys, timeout)
        self._watchdog = Watchdog(env, self.store, heartbeat_timeout, lambda: self.aborted, waits,
                                  judge_peers=not elastic)
        if elastic:  # after a change its rank and world size are the new group's
            self.membership = Membership.of(self, self._store, heartbeat_timeout, timeout, env.attempt)

    def watch_as_joiner(self, env: Environment, store: dist.Store,
                        heartbeat_timeout: float | None, timeout: float | None) -> Membership:
        """A joiner of a running elastic job (:mod:`shoal.core.admission`), built alone: beat in
        the job's ``store`` as worker ``env.rank`` of a job first of ``env.world_size``, in
        no group yet (until :meth:`Membership.enter`)."""
        self.store = store
        self._store = dist.PrefixStore(key_prefix(env.attempt), store)
        self._rank0_hosts = False
        self._watch(env, heartbeat_timeout, timeout, elastic=True)
        assert self.membership is not None
        self.membership.members = []
        return self.membership

    def _meet(self, run: Callable[[], _T], keep: torch.Tensor | None = None) -> _T | None:
        """``run()`` a collective (waited for if it returns its work); elastic: voted on, held
        again in a re-formed group from ``keep`` (:meth:`Membership.meet`), skipped alone."""
        if self.membership is None:
            result = run()
            return result.wait() if isinstance(result, dist.Work) else result
        return self.membership.meet(lambda: run() if self.active else None, keep)

    @property
    def active(self) -> bool:
        """True when there are other ranks to talk to."""
        return self.peers and self.world_size > 1 and dist.is_initialized()

    def child(self, env: Environment) -> Comm:
        """A Comm for the default process group this process joined as ``env.rank`` of
        ``env.world_size`` (a compute group inside an asynchronous job); its time and bytes
        count on this Comm too."""
        comm = Comm(env, self.device, self.timeline)
        comm._parent = self
        return comm

    def join_subgroup(self, name: str, rank: int, size: int, timeout: float) -> Comm:
        """Join the process group ``name`` of ``size`` processes on the job's store (a compute
        group of an asynchronous job, whose ranks share no process group of the whole job) as
        its rank ``rank``; its Comm is :attr:`subgroup` (a :meth:`child` of this one)."""
        if self.store is None:
            raise ShoalError(f"{name}: a group meets through the job's store; this process has none")
        if dist.is_initialized():
            raise ShoalError(f"{name}: this process already belongs to a process group")
        join_group(dist.PrefixStore(name, self.store), rank, size, self.device.type, timeout,
                   where=f"the group {name}")
        self.subgroup = self.child(Environment(rank=rank, world_size=size, local_world_size=size))
        return self.subgroup

    # -- accounting -------------------------------------------------------------------------
    def count(self, nbytes: int) -> None:
        """Book ``nbytes`` of payload sent by a collective issued outside this class."""
        self.bytes_sent += int(nbytes)
        if self._parent is not None:
            self._parent.count(nbytes)

    def point_to_point(self, name: str, nbytes: int) -> contextlib.AbstractContextManager[None]:
        """Book an exchange issued outside this class (a parameter server's push and pull,
        :mod:`shoal.ps`; nothing else is booked inside it): its time as communication and,
        once it succeeded, its ``nbytes`` of payload as sent by this rank."""
        return self.timeline.leaf(COMM, name, lambda: self.count(nbytes))

    @contextmanager
    def track(self, op: str, name: str | None = None) -> Iterator[None]:
        """Count a collective issued outside this class (DDP's all-reduce, inside backward)
        as this rank's next one, in flight while the body runs: a long wait in it then names
        the ranks that did not come. Every rank must track the same ones."""
        if not self.active:
            yield
            return
        with self.log.track(describe(op, name)), (
                self.membership.voted() if self.membership else contextlib.nullcontext()):
            yield

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", name: str = "allreduce") -> torch.Tensor:
        """Reduce ``tensor`` in place across ranks (``avg`` divides by the world size)."""
        return self.all_reduce_async(tensor, op, name).wait()

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum", name: str = "allreduce") -> Handle:
        """Start an in-place all-reduce; the returned handle's ``wait()`` finishes it."""
        red = reduce_op(op)
        if not self.active:
            return Handle(self, None, tensor, op, name)
        if self.membership is not None:  # voted, so finished here: no overlap
            self.count(tensor.numel() * tensor.element_size())
            with self.timeline.span(COMM, name), self.log.track(named("all_reduce", name)):
                self._meet(lambda: dist.all_reduce(tensor, op=red, async_op=True), keep=tensor)
            return Handle(self, None, tensor.div_(self.world_size) if op == "avg" else tensor,
                          op, name)
        nbytes = self._start(tensor)  # counted, and in flight (its peak too) until the wait
        if self.host is not None and self.host.takes(tensor, op):  # done when it returns
            self.in_flight -= nbytes
            with self.timeline.span(COMM, name), self.log.track(named("all_reduce", name, "allreduce")):
                return Handle(self, None, self.host.all_reduce(tensor, op), op, name)
        seq = self.log.start(named("all_reduce", name, "allreduce"))  # finished by its wait
        with self.timeline.span(COMM, name):
            work = dist.all_reduce(tensor, op=red, async_op=True)
        return Handle(self, work, tensor, op, name, seq, nbytes)

    def all_gather_async(self, tensor: torch.Tensor, name: str = "allgather") -> Handle:
        """Start gathering the 1-D ``tensor`` of every rank; the handle's ``wait()`` returns
        them as the rows of a ``(world_size, len)`` tensor, in rank order. This rank's bytes
        are its own ``tensor``'s."""
        if not self.active:
            return Handle(self, None, tensor.view(1, -1), "gather", name)
        if self.membership is not None:  # voted, so finished here (held again if it fails)
            return self._all_gather_met(tensor, name)
        out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        nbytes = self._start(tensor)
        seq = self.log.start(named("all_gather", name, "allgather"))  # finished by its wait
        with self.timeline.span(COMM, name):
            work = dist.all_gather(list(out.view(self.world_size, -1).unbind(0)), tensor,
                                   async_op=True)
        return Handle(self, work, out.view(self.world_size, -1), "gather", name, seq, nbytes)

    def _all_gather_met(self, tensor: torch.Tensor, name: str) -> Handle:
        """Elastic: the all-gather as a meeting, its rows those of the group that held it."""
        rows: list[torch.Tensor] = []

        def run() -> Any:
            rows[:] = [tensor.new_empty(self.world_size, tensor.numel())]
            return dist.all_gather(list(rows[0].unbind(0)), tensor, async_op=True)

        self.count(tensor.numel() * tensor.element_size())
        with self.timeline.span(COMM, name), self.log.track(named("all_gather", name)):
            self._meet(run)
        got = rows[0] if rows and self.active else tensor.view(1, -1)  # alone: its own row
        return Handle(self, None, got, "gather", name)

    def _start(self, tensor: torch.Tensor) -> int:
        """Count ``tensor``'s bytes as sent and in flight (until its handle's wait)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.count(nbytes)
        self.in_flight += nbytes
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return nbytes

    def all_reduce_future(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Start an in-place sum of ``tensor`` for a DDP communication hook; returns the
        future DDP waits on (its value: ``[tensor]``). Its bytes are counted, not its time:
        it runs behind the rest of backward, and what that did not hide is booked later
        (:meth:`book_exposed`)."""
        if not self.active:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result([tensor])
            return done
        self.count(tensor.numel() * tensor.element_size())
        return self.log.follow(describe("all_reduce", "bucket"), lambda: dist.all_reduce(
            tensor, op=dist.ReduceOp.SUM, async_op=True), self.membership and self.membership.watched)

    def watch_future(self, future: torch.futures.Future) -> torch.futures.Future:
        """A DDP hook's ``future`` that issued its collectives itself (PowerSGD's), followed
        as one bucket's all-reduce and, under ``--elastic``, failed as soon as the step's
        meeting is voted failed (its own collectives stay with the group left)."""
        if self.membership is None:
            return future
        return self.log.follow(describe("all_reduce", "bucket"), lambda: FutureWork(future),
                               self.membership.watched)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, name: str = "broadcast") -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s."""
        if self.active:
            self.count(tensor.numel() * tensor.element_size())
            with self.timeline.span(COMM, name), self.log.track(named("broadcast", name)):
                self._meet(lambda: dist.broadcast(tensor, src=src, async_op=True))
        return tensor

    def barrier(self, booked: bool = True) -> None:
        if self.active:  # booked=False: not in the timeline (before a run's clock starts)
            span = self.timeline.span(WAIT, "barrier") if booked else contextlib.nullcontext()
            with span, self.log.track("barrier"):
                self._meet(lambda: dist.barrier(async_op=True))

    # -- time learnt later: collectives timed from outside (DDP's, in backward) -------------
    def book_exposed(self, start: float, end: float, name: str = "allreduce") -> Event | None:
        """Book ``start`` to ``end`` (``perf_counter`` times, inside the open span) as
        communication that compute did not hide: e.g. DDP's all-reduce from the moment the
        last gradient was ready to the end of backward. Returns the kept trace event, if
        any, for :meth:`book_wait`."""
        return self.timeline.record(COMM, name, start, end)

    def book_wait(self, seconds: float, exposed: Event | None,
                  name: str = "wait for slowest rank") -> None:
        """The first ``seconds`` of communication booked by :meth:`book_exposed` (its event
        ``exposed``, if kept) turn out to have been waiting for a slower rank: book them as
        wait."""
        self.timeline.reassign(seconds, COMM, WAIT, exposed, name)

    # -- failure handling -------------------------------------------------------------------
    @property
    def attempt_store(self) -> dist.Store | None:
        """The job's store under this attempt's prefix (where shoal's launcher keeps its keys)."""
        return self._store

    def ended(self, rank: int, timeout: float) -> str | None:
        """How lost rank ``rank``'s process ended (``killed by signal 9``) as shoal's launcher
        says in the store, within ``timeout`` s; ``None``: not said (another launcher, alive)."""
        if self._store is None:
            return None
        key, deadline = ended_key(rank), time.monotonic() + timeout
        try:  # polled: a store wait that times out prints c10d's warnings
            while not self._store.check([key]):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
            return self._store.get(key).decode()
        except Exception:  # the store is gone
            return None

    def abort(self, message: str, *, echo: bool = False) -> None:
        """Tell every other rank that this one failed, so they exit instead of waiting.

        The first report stands (a later one is most likely its echo). A rank that another
        rank's watchdog already reported (hung while it did not run, gone, never come) leaves
        here at once, without a report of its own: what it raises is the echo of that.
        Without peers (an asynchronous job's rank) nobody waits on this one: nothing to tell.
        ``echo``: a lost connection, reported as the leaving of a rank that left first.
        """
        self.aborted = True  # first: this rank's watchdog must not take the report for another's
        if self._store is None or not self.peers:
            return
        first = (message.strip().splitlines() or ["failed"])[0][:300]
        report = f"rank {self.rank}: {first}"
        try:
            if echo and (gone := departures(self._store, self._keys, self.world_size, {})):
                rank, (_, how) = min(gone.items())
                report = f"rank {rank}: {LEFT_EARLY.format(how=how)}"
                if self._error_dir:  # shoal's launcher: the root cause, over this rank's echo
                    record_for(self._error_dir, rank, report.partition(": ")[2], "",
                               f"rank {self.rank}'s collective lost its connection to it")
            standing = self._store.compare_set(ABORT_KEY, "", report).decode()
        except Exception:  # the store may be gone already; the launcher still reaps us
            return
        if standing != report and standing.startswith(f"rank {self.rank}: "):
            os._exit(EXIT_ABORTED)

    def close(self, how: str = "left the job") -> None:
        """Wait for every rank, stop the watchdog (and elastic's in-flight watch) and leave
        the process group. The wait is in the job's store, not a collective: this rank says
        there that it left after its collectives so far, and ``how`` (``"returned"``), shuts
        its group's connections down (a rank still in a collective with it, even one of its
        own ``torch.distributed`` calls, fails at once and names this one, as :meth:`abort`
        says) and waits until every rank left (shoal's launcher says it for a rank that ended
        with ``os._exit(0)``). After :meth:`abort` it does not wait."""
        finished = False
        try:
            if self.membership is not None and not self.aborted:
                self.barrier()  # voted: a worker lost at the end is not waited for
            elif self.membership is None and self.active and not self.aborted:
                with self.log.at_end():
                    if self._store is None:
                        dist.barrier()
                    else:
                        say_left(self._store, self._keys, self.rank, self.world_size, how,
                                 self.log.count)
                        hang_up()  # a rank still in a collective with this one fails now
                        self._store.wait([self._keys.all_left])  # the store's timeout bounds it
                finished = True
        finally:
            if self._watchdog is not None:
                self._watchdog.stop(timeout=5.0)
            for membership in (self.membership, self.subgroup and self.subgroup.membership):
                if membership is not None:  # a compute group's too
                    membership.inflight.stop(timeout=5.0)
            try:
                if finished and self.active and self._rank0_hosts and self._store is not None:
                    # Rank 0 hosts the store: it must not exit while another rank's
                    # watchdog may still be asking it. A store call cut off while the
                    # interpreter shuts down ends the process in std::terminate (signal 6).
                    say_closed(self._store, self._keys, self.world_size)
                    if self.rank == 0:
                        self._store.wait([self._keys.all_closed])
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()


#: Comms made on a job's store by this process so far (see :class:`~shoal.core.waits.Keys`).
_GENERATIONS = itertools.count()
