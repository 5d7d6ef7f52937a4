"""``--elastic`` for the asynchronous strategies: a lost worker's unfinished work is dealt
over the workers left, so that every sample of every epoch is trained exactly once.

A worker's samples *count* once an exchange carried their work to the servers and server 0
applied it (a pushed gradient; the elastic strategies' ``x``, sent before the local step,
carries the steps before it; at its end a worker makes one more exchange for the steps
after its last). Each exchange says how many samples of the worker's schedule
(:mod:`shoal.train.membership.schedule`) it carries, and server 0 keeps the count of the last one applied.
When a worker is lost, server 0's :class:`~shoal.train.membership.server.dealer.Dealer` deals the rest of its
schedule over the workers left and publishes the deal in the job's store; each worker looks
for new deals between its steps (every 50 ms at most), reports where it takes its share, and
trains it. When a worker joins, each gives it a part of its rest the same way, from where it
is (:meth:`AsyncElastic.join` is the joiner's start).
A worker that has trained its schedule waits for server 0 to release it: a worker lost
later may still leave it work. Nobody waits for anybody otherwise.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from shoal.core.membership import MembershipChanged
from shoal.core.stop import Leaving, leave_requested, request_stop
from shoal.data import EpochPlan
from shoal.strategies.asynchronous import detached
from shoal.train.membership.context import LoopContext
from shoal.train.membership.messages import Adopt, Give, Lead, Leave, encode
from shoal.train.membership.resume import Start, rebuild, uncounted
from shoal.train.membership.samples import cut_upto, record_since, samples_file
from shoal.train.membership.schedule import Schedule, cut, length, slots_of
from shoal.train.membership.tracker.compute_group import Seat, gone_key, grouped, leader_lost
from shoal.train.membership.tracker.deals import POLL_S, TakesDeals, leave_key
from shoal.train.optim import schedule_at

log = logging.getLogger("shoal.membership")

_Step = TypeVar("_Step")


class AsyncElastic(TakesDeals):
    """A detached worker's side: it walks its :class:`Schedule` block by block (one a
    trainer epoch, in batches of its share of the global batch), takes the shares dealt to
    it, records its samples as they count (``--record-samples``) and, at its end, waits
    for server 0's release. Same interface as
    :class:`~shoal.train.membership.tracker.process_group.Elastic`."""

    def __init__(self, trainer: LoopContext) -> None:
        t = self.t = trainer
        self.store, self.me = t.comm.attempt_store, t.comm.rank
        workers = t.comm.world_size
        # A compute group (``groups``) walks its first worker's schedule, every member its
        # part of each batch, in lockstep: only the first reports, records and is dealt to.
        strategy = self.strategy = detached(t.strategy)
        self.unit, end = strategy.seat()
        self.seat = Seat(strategy, self.me, self.unit, end)
        size = self.seat.size
        self.slots = slots_of(t.cfg, len(t.data.train), workers)
        self.schedule = Schedule(self.slots, self.unit, t.cfg.epochs, size) \
            if self.me < workers else Schedule.empty(t.cfg.epochs)  # a joiner: what it is given
        self.batch = max(1, t.cfg.global_batch(workers) // workers) * size
        strategy.group_batches = strategy.grouped  # its batches are its group's (a joiner's own)
        if size > 1:  # its members take the deals its leader read, in lockstep
            grouped(strategy).deal_count = self._published
        self.seen = 0  # deals read
        self.former: tuple[int, ...] = ()  # a compute group's leaders lost: their deals are its
        self.acts: list[Adopt | Give] = []  # a compute group's shares taken, parts given
        self.polled = 0.0
        self.looked = (0.0, 0)  # a compute group's leader: when it read the deals published
        self.stopped_job = False  #: its leave stopped the job: it was the last worker
        self.offset = 0  # samples of this block before the current plan
        self.epochs = torch.zeros(0, dtype=torch.long)  # the current plan's samples' epochs
        self.trained: list[tuple[torch.Tensor, torch.Tensor]] = []  # (epochs, samples), uncounted
        self.at = 0  # the schedule position of self.trained's first sample
        self.record = samples_file(t.cfg, self.me) if self.me == self.unit else None
        self.steps = t.plan.steps_per_epoch  # an epoch's steps for the schedule
        self.dealt = False  # a share was taken: the schedule follows the blocks' share read
        self.planned, self.resume_at = -1, 0  # the block planned last; where the next starts
        t.checkpointer.elastic_part = self.state_dict
        payload = t.checkpointer.elastic_payload  # --resume
        if payload is not None:
            t.checkpointer.elastic_payload = None
            # a compute group's members go on from its first's position, which is theirs
            self._go_on(rebuild(payload, workers, self.slots, t.cfg.epochs)[self.unit])

    def state_dict(self) -> dict[str, int]:
        """This worker's position for a checkpoint: its block, the samples of it read, the
        samples of its schedule that counted (:mod:`shoal.train.membership.resume`)."""
        epoch = self.t.state.epoch
        return {"epoch": epoch, "read": self._read() if self.planned == epoch else 0,
                "at": self.at}

    def _go_on(self, start: Start) -> None:
        """``--resume``: this worker's schedule and position, as the checkpoint's."""
        t = self.t
        self.schedule, self.resume_at, self.at = start.schedule, start.offset, start.at
        self.trained, self.dealt = uncounted(self.slots, start), True
        cut_upto(self.record, start.at)  # what it counted after the checkpoint is redone
        if start.back:  # lost before the checkpoint: from the center, at its count
            t.state.epoch, t.state.step = start.epoch, start.epoch * self.steps
            schedule_at(t.scheduler, t.state.step)
            self.strategy.go_on_from(start.position)
        elif t.state.epoch > start.epoch and self.schedule.rest(start.position):
            t.state.epoch = start.epoch  # it had ended, and is given work: its last block

    @contextmanager
    def updating(self) -> Iterator[None]:
        yield

    def step(self, train_step: Callable[[Any], _Step]) -> _Step:
        """A step; in a compute group that lost a member in DDP's all-reduce, the step
        again, its group batch split over the members left."""
        while True:
            try:
                return train_step(self.t.batches)
            except MembershipChanged:
                self.t.strategy.zero_grad()
                self._regrouped()

    def _regrouped(self) -> None:
        """After a compute group was re-formed (:class:`~shoal.train.membership.tracker.compute_group.Seat`):
        a lost leader's place taken, the rest of the block from the step being taken
        planned over the group as it is, the lost members' rows told to server 0."""
        if self.seat.orphaned is not None:
            self._take_over()
        if self.seat.moved:
            self._plan(self._read())
        self.seat.tell_lost(self.t.comm.ps)

    def _take_over(self) -> None:
        """The compute group's leader was lost: its first member alive takes its place at
        the servers where server 0 applied every exchange the group counts (its count of
        the leader is the group's); else (lost in its exchange) the group leaves as lost
        workers do, and server 0 deals its rest from its count."""
        t, seat = self.t, self.seat
        old, seat.orphaned = seat.orphaned, None
        key = gone_key(old)
        said = json.loads(self.store.get(key)) if self.store.check([key]) else {}
        if said.get("counted") != self.strategy.counted:
            self._count()
            why = f"{leader_lost(old, seat.end)} in its exchange"
            log.warning(f"shoal: worker {self.me} {why}")
            raise Leaving(t.state.step, why)
        self.former = (*self.former, old)
        self.unit = seat.first = grouped(self.strategy).first = seat.members[0]
        if self.me == self.unit:  # told before its first exchange, with the group's deals
            self.record = samples_file(t.cfg, self.me)
            t.comm.ps.report(encode(Lead(old, tuple(self.acts))))
            log.info(f"shoal: worker {self.me} leads its compute group in worker {old}'s place")

    def start_epoch(self) -> None:
        self._plan(self.resume_at)
        self.resume_at = 0

    def _plan(self, offset: int) -> None:
        """The rest of this block, from its ``offset``-th sample, as the trainer's plan."""
        t = self.t
        self.offset, self.planned = offset, t.state.epoch
        order, self.epochs = self.slots.samples(cut(self.schedule.blocks[t.state.epoch],
                                                    offset)[1])
        self.seat.planned()
        t.install_plan(EpochPlan(len(order), self.batch, self.seat.size, t.cfg.seed, order),
                       self.seat.index)
        t.state.epoch_step = 0

    def _read(self) -> int:
        """Samples of this block read so far."""
        plan, step = self.t.plan, self.t.state.epoch_step
        return self.offset + (plan.bounds[step - 1][1] if step else 0)

    # -- the loop -----------------------------------------------------------------------------
    def steps_left(self) -> bool:
        """Whether the block has a step left; after the last block, whether work was dealt
        to this worker before server 0 released it."""
        t = self.t
        if t.state.epoch_step < t.plan.steps_per_epoch:
            return True
        if t.state.epoch + 1 < t.cfg.epochs:
            t.strategy.end_epoch(t.state.epoch)
            return False
        if self._wait_for_release():
            return True
        t.strategy.end_epoch(t.state.epoch)
        return False

    def step_done(self) -> None:
        """After each step: its samples, those that count now, and a look for new deals."""
        t = self.t
        self._read_step(t.state.epoch_step - 1)
        self._count()
        self._regrouped()  # in the step's update: the next step is split anew
        if leave_requested():
            self._leave()
        if self.seat.size > 1:  # the deals the leader read before this step's exchange
            self._poll(grouped(self.strategy).agreed_deals)
        elif time.monotonic() - self.polled >= POLL_S:
            self._poll()
        if self.dealt:  # the share of this epoch's block read, not the count of steps
            block = length(self.schedule.blocks[t.state.epoch])
            read = min(self._read() / block, 1.0) if block else 1.0
            schedule_at(t.scheduler, t.state.epoch * self.steps + round(self.steps * read))

    def _read_step(self, step: int) -> None:
        """The samples of the plan's step ``step``, trained: counted once an exchange
        carries them (:meth:`_count`)."""
        lo, hi = self.t.plan.bounds[step]
        self.trained.append((self.epochs[lo:hi], self.t.plan.order[lo:hi]))
        self.seat.read(hi - lo, self.t.state.epoch)

    def _count(self) -> None:
        """Record the samples whose work reached the servers (the strategy's count)."""
        counted, done = self.strategy.counted, {}
        while self.trained and self.at < counted:
            epochs, samples = self.trained[0]
            take = min(len(samples), counted - self.at)
            if take < len(samples):
                self.trained[0] = (epochs[take:], samples[take:])
            else:
                self.trained.pop(0)
            for e in epochs[:take].unique().tolist():
                done.setdefault(e, []).append(samples[:take][epochs[:take] == e])
            self.at += take
        if self.record is not None and done:
            counted = {e: torch.cat(s) for e, s in sorted(done.items())}
            record_since(self.record, self.at, lambda _: counted)

    def _leave(self) -> None:
        """SIGTERM to ``shoal join``: send this worker's work (all it trained counts) and
        leave (its ``shoal join`` says why in the store); server 0 deals its rest to the
        others. Server 0 is asked first (its answer in the store): the last live worker
        stops the job instead, as a SIGTERM to the launcher would, with a checkpoint."""
        t = self.t
        self.strategy.flush()
        self._count()
        t.comm.ps.report(encode(Leave()))
        key, deadline = leave_key(self.me), time.monotonic() + t.cfg.heartbeat_timeout
        while not self.store.check([key]) and time.monotonic() < deadline:
            time.sleep(POLL_S)  # no answer in time: it leaves
        if not self.store.check([key]) or self.store.get(key) != b"stop":
            raise Leaving(t.state.step)
        request_stop()
        self.stopped_job = True


__all__ = ["AsyncElastic"]
