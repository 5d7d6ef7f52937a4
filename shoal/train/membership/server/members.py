"""Server 0's side of an asynchronous ``--elastic`` job, as the coordinator sees it:
:class:`AsyncMembers` (its :class:`~shoal.train.membership.server.dealer.Dealer`, the epoch each joiner starts
at, the samples each worker's reports account for) and :class:`JoinDesk` (the answers to
``shoal join``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from shoal.core.admission import BAD_PROOF, proved, worker_id
from shoal.core.stop import request_stop, stop_requested
from shoal.core.waits import ELASTIC
from shoal.errors import ShoalError
from shoal.train.membership.changes import joined_change, of_records
from shoal.train.membership.messages import (
    CheckpointPart,
    EpochEnd,
    Joined,
    Lead,
    Leads,
    Leave,
    Report,
    ReportKind,
    Rest,
    Rows,
    Serve,
)
from shoal.train.membership.resume import dealer_state, rebuild, schedule_of
from shoal.train.membership.samples import cut_upto, samples_file
from shoal.train.membership.schedule import length
from shoal.train.membership.server.context import ServerContext
from shoal.train.membership.server.dealer import Dealer
from shoal.train.membership.tracker.compute_group import gone_key
from shoal.train.membership.tracker.deals import leave_key

log = logging.getLogger("shoal.membership")


class JoinDesk:
    """Server 0's answers to ``shoal join`` in an asynchronous ``--elastic`` job: each
    request (:mod:`shoal.core.admission`'s ticket and proof) checked and answered between
    the coordinator's reports, and a worker admitted through ``admit(joiner)``."""

    def __init__(self, store: Any, seal: Any, first: int, cap: int) -> None:
        import torch.distributed as dist

        self.keys = dist.PrefixStore(ELASTIC, store)
        self.seal, self.first, self.cap = seal, first, cap
        self.handled = 0

    def answer(self, live: int, ending: bool, admit: Callable[[int], int]) -> None:
        """Answer every request asked since the last look, the job having ``live``
        workers (``ending``: none has work left); ``admit(joiner)`` admits one and returns
        the epoch it starts at."""
        asked = int(self.keys.add("join/asked", 0))
        while self.handled < asked:
            self.handled += 1
            ticket, why = self.handled, None
            joiner = worker_id(self.first, ticket)
            if not proved(self.keys, self.seal, ticket):
                why = BAD_PROOF
            elif live >= self.cap:
                why = (f"the job has {live} workers, its most (--max-workers {self.cap}); a "
                       "worker may join once one is lost")
            elif ending:
                why = "the job is ending: no worker has work left to give it"
            reply: dict[str, Any] = {"refused": why}
            if why is None:
                try:
                    reply, live = {"epoch": admit(joiner), "joined": [joiner]}, live + 1
                except ShoalError as exc:  # a staleness bound that cannot take one more
                    reply = {"refused": str(exc)}
            self.keys.set(f"join/{ticket}/answer", json.dumps(reply))


class AsyncMembers:
    """The coordinator's ``--elastic`` side (``c``: the
    :class:`~shoal.train.coordinator.Coordinator`): its :class:`Dealer`, its
    :class:`JoinDesk` (where the job's join secret ``seal`` is known) and the epoch each
    joiner starts at."""

    def __init__(self, c: ServerContext, seal: Any, groups: tuple[tuple[int, int], ...] = ()) -> None:
        self.c, store = c, c.comm.attempt_store
        self.dealer = Dealer(c.cfg, store, len(c.data.train), c.workers, c.servers, groups)
        self.desk = JoinDesk(store, seal, c.workers, c.cfg.max_workers or c.workers) \
            if seal is not None and store is not None else None
        self.first_epoch: dict[int, int] = {}  # a joiner -> the epoch (from 0) it starts at
        #: how far into each worker's schedule its samples are in the records' count (its
        #: epochs reported; a lost worker's counted samples are added at its loss)
        self.accounted: dict[int, int] = {}
        self.leaving: set[int] = set()  #: workers that said they leave (SIGTERM to shoal join)
        self.reported: dict[int, set[int]] = {}  # a worker -> the epochs (from 1) it reported
        #: (compute group's leader, block) -> rows of its members lost, told by the leader
        self.told: dict[tuple[int, int], int] = {}
        self._handlers: dict[ReportKind, Callable[[int, Any], None]] = {
            ReportKind.ADOPT: self.dealer.take, ReportKind.GIVE: self.dealer.take,
            ReportKind.IDLE: self.dealer.take, ReportKind.ROWS: self._rows,
            ReportKind.LEAD: self._lead, ReportKind.JOINED: self._joined,
            ReportKind.LEAVING: self._leaving}

    def take(self, worker: int, report: Report) -> bool:
        """Take ``worker``'s ``report`` if it is of this side's kinds (a share taken, a part
        given, idle, joined, leaving, a lost member's rows, a new leader).

        Returns:
            Whether it was (else it is the coordinator's).
        """
        handler = self._handlers.get(report.KIND)
        if handler is not None:
            handler(worker, report)
        return handler is not None

    def resting(self, client: int, report: Report) -> None:
        """Called on ``client``'s serving thread: its rest (``idle``) or return to work
        (``adopt``) told to the shards at once (a staleness bound must not wait for it)."""
        if report.KIND in (ReportKind.IDLE, ReportKind.ADOPT):
            resting = report.KIND == ReportKind.IDLE
            self.c.shard.rest(client, resting)
            if self.c.followers is not None:
                self.c.followers.tell(Rest(client, resting))

    def epoch(self, worker: int, report: EpochEnd) -> None:
        """``worker`` reported an epoch: its schedule is at that block's start."""
        if worker in self.dealer.schedules:
            done = self.dealer.schedules[worker].start(min(report.epoch, self.c.cfg.epochs))
            self.accounted[worker] = max(self.accounted.get(worker, 0), done)
            self.reported.setdefault(worker, set()).add(report.epoch)

    def _rows(self, worker: int, report: Rows) -> None:
        """A compute group's member lost: its rows of the blocks it never reported."""
        said = self.reported.get(report.worker, set())
        for block, n in report.rows.items():
            if block + 1 not in said:
                self.c.state.samples += n
                key = (report.group, block)
                self.told[key] = self.told.get(key, 0) + n

    def _lead(self, worker: int, report: Lead) -> None:
        """A compute group's member in its lost leader's place."""
        old = report.group
        self.dealer.lead(worker, old, report.acts, self.c.live - self.c.finals.keys())
        self.accounted[worker] = self.accounted.get(old, 0)
        self.c.shard.lead(worker)
        if self.c.followers is not None:
            self.c.followers.tell(Leads(worker))

    def _joined(self, worker: int, report: Joined) -> None:
        """A joiner's first state, for its join's record."""
        mine = self.c.shard.first_pulls.pop(worker, None)
        if self.c.followers is not None:  # the other servers' shards of it
            mine = self.c.followers.first_pull(worker, mine)
        self.dealer.digests(worker, mine, report.digest)

    def _leaving(self, worker: int, report: Leave) -> None:
        """SIGTERM to its shoal join: the last one stops the job."""
        self.leaving.add(worker)
        last = not self.c.live - self.c.finals.keys() - self.leaving
        if last:
            request_stop()
        self.c.comm.attempt_store.set(leave_key(worker), "stop" if last else "go")

    def _account(self, unit: int, counted: int) -> None:
        """``unit`` (a worker, a compute group by its leader) is lost at its ``counted``
        samples. What its work carried into the center since its last epoch report is in
        no record (its sums of that epoch are gone with it): the samples count it all the
        same, less the rows its group's leader told of its members lost. What it reported
        past its count is dealt again and will be reported again: once only."""
        block = max(self.reported.get(unit, set()) | {0})  # its blocks reported
        told = sum(n for (u, b), n in self.told.items()
                   if b >= block and u in (unit, *self.dealer.former.get(unit, ())))
        self.c.state.samples += counted - self.accounted.get(unit, 0) - told
        self.accounted[unit] = counted

    def due(self, epoch: int) -> set[int]:
        """The live workers epoch ``epoch`` (from 1) is recorded from: not those that
        joined after it began."""
        return {w for w in self.c.live if self.first_epoch.get(w, 0) < epoch}

    def lost(self, worker: int, info: dict[str, Any]) -> None:
        """What ``worker`` left dealt over the workers still training."""
        c = self.c

        def why() -> str:  # asked after the deal is out: the launcher's word may take a while
            status = c.ended(c.servers + worker) if c.ended is not None else None
            return f"worker {worker} {status}" if status else \
                f"worker {worker} stopped answering ({info.get('error', 'connection lost')})"

        counted = int(info.get("counted", 0))
        # Its compute group re-forms without it; a lost leader's place is taken where this
        # count is the group's.
        if c.comm.attempt_store is not None:
            c.comm.attempt_store.set(gone_key(worker), json.dumps({"counted": counted}))
        c.own.pop(worker, None)  # its state is not one to resume: its rest was dealt
        live = c.live - c.finals.keys()
        unit = self.dealer.unit_of(worker)
        if not self.dealer.heirs(unit, live):  # a group goes on: its members report
            self._account(unit, counted if unit == worker else self.dealer.lost_at[unit])
        if unit != worker:  # a compute group's member (it never pushes): where its group is
            info = {**info, "step": c.shard.steps.get(unit, 0),
                    "group_at": c.shard.samples.get(unit, 0)}
        if not int(info.get("step", 0)):  # it never stepped (a joiner lost before its first
            info = {**info, "step": self._job_step(live)}  # exchange): the job's step
        dealt = self.dealer.lost(worker, info, live, why)
        c.recorder.changes = self.dealer.changes
        c.lost[worker].update(samples_trained=counted,
                              samples_not_trained=0, samples_dealt_again=dealt)

    def checkpoint(self, servers: list[dict[str, Any]], savers: dict[int, CheckpointPart]
                   ) -> tuple[dict[str, Any], int]:
        """Server 0's part of a checkpoint whose workers' states are ``savers``' (their
        reports; :func:`~shoal.train.membership.resume.dealer_state`); ``servers``: every server's
        state, whose least count of a worker is what of it counts (hogwild's: the shared
        file's). Each server's saved counts become where each worker goes on from, so that one
        lost after the resume before its first exchange leaves what it had not counted only.
        With it, the samples the file counts that no report carried yet: a worker with no
        state in it (a joiner) is not started again, its work to its count stands."""
        c, dealer = self.c, self.dealer

        def count(w: int) -> int:
            if c.counted_of is not None and c.followers is None:  # hogwild
                return int(c.counted_of(w, {})[0])
            return min(int(s.get("counted", {}).get(w, 0)) for s in servers)

        others = sorted(w for w in c.live if w not in savers and w not in dealer.gone)
        counts = {w: count(w) for w in others}
        going_on = {**dealer.lost_at, **counts,
                    **{w: int(r.own["elastic"]["at"]) for w, r in savers.items()}}
        for server in servers:
            server["counted"] = dict(going_on)
        unreported = sum(n - self.accounted.get(w, 0) for w, n in counts.items())
        return dealer_state(dealer, counts, dict(dealer.lost_at), max(dealer.schedules) + 1,
                            {**self.accounted, **counts},
                            {w: e for w, e in self.first_epoch.items() if w < c.workers}
                            ), unreported

    def resume(self, payload: dict[str, Any]) -> None:
        """Go on from ``payload``: every worker's schedule rebuilt, the workers lost before
        it back (a membership change) and the next joiner's id past every earlier one's."""
        c = self.c
        part = payload["coordinator"]["elastic"]
        for w, count in part["counts"].items():  # a joiner's samples to its count, unless
            if w >= c.workers:  # its file has them: it is not started again
                self.dealer.schedules[w] = schedule_of(part["schedules"][w])
                cut_upto(samples_file(c.cfg, w), int(count))  # its rest is dealt to others
                self.dealer.record_counted(w, int(count))
        starts = rebuild(payload, c.workers, self.dealer.slots, c.cfg.epochs)
        back = sorted(w for w, s in starts.items() if s.back)
        changes = of_records(part["changes"])
        if back:
            given = sum(length(starts[w].schedule.rest(starts[w].position)) for w in back)
            changes.append(joined_change(int(payload["progress"]["step"]),
                                         min(starts[w].epoch for w in back), back, c.workers,
                                         given, "back at --resume"))
            log.info(f"shoal: {'worker' if len(back) == 1 else 'workers'} "
                     f"{', '.join(map(str, back))} {'is' if len(back) == 1 else 'are'} back at "
                     f"--resume with the {given} samples given")
        self.dealer.resume(starts, changes)
        c.recorder.changes = self.dealer.changes
        self.accounted = {int(w): int(n) for w, n in part.get("accounted", {}).items()}
        # A worker back at an earlier resume may have started past epochs not recorded yet.
        self.first_epoch = {int(w): int(e) for w, e in part.get("first", {}).items()}
        for w in back:
            # to its count: in the records, or added when it was lost; its samples to it in
            # its file, unless the file has them (lost, and not seen so yet)
            self.accounted[w] = starts[w].position
            self.dealer.record_counted(w, starts[w].position)
            self.first_epoch[w] = starts[w].epoch
        if self.desk is not None:
            self.desk.first = int(part["next"])

    def tick(self) -> None:
        """Between reports: answer join requests, deal the gives complete, release."""
        c, dealer = self.c, self.dealer
        live = c.live - c.finals.keys()
        if self.desk is not None:
            ending = dealer.released or all(w in dealer.idle for w in live)
            self.desk.answer(len(live), ending, self._admit)
            live = c.live - c.finals.keys()
        dealer.given(live)
        if stop_requested():
            dealer.stop(live)
        dealer.release(live)

    def _job_step(self, live: set[int]) -> int:
        """The job's step: the furthest of the ``live`` workers' (where a join, or the loss
        of a worker that never stepped, stands in ``membership_changes``)."""
        return max((self.c.shard.steps.get(w, 0) for w in live), default=0)

    def _admit(self, joiner: int) -> int:
        """Serve ``joiner`` and ask the others for its part; the epoch it starts at."""
        c = self.c
        # It connects right after its answer (its data loaded already): a joiner lost before
        # it connects is lost within the heartbeat timeout, not --timeout. A staleness bound
        # that cannot take one more refuses it.
        wait = min(c.cfg.heartbeat_timeout, c.cfg.timeout)
        c.shard.add_client(joiner, wait)
        if c.followers is not None:  # served by every server before it is answered
            c.followers.tell(Serve(joiner, wait))
        self.first_epoch[joiner] = epoch = c.state.epoch
        live = c.live - c.finals.keys()  # its step: the furthest live worker's now
        self.dealer.admit(joiner, live, self._job_step(live), epoch)
        c.live.add(joiner)
        if c.started is not None:  # it trains what it is dealt: the clock waits not for it
            c.started.add(joiner)
        c.recorder.changes = self.dealer.changes
        return epoch


__all__ = ["AsyncMembers", "JoinDesk"]
