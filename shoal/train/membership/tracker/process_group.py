"""A training run under elastic membership (``--elastic``): who trains what after a worker
is lost, and what the run keeps of it.

The core (:mod:`shoal.core.membership`) re-forms the group; this module hears of it and
hands the lost workers' unfinished work to the workers left, so that every sample of every
epoch is trained exactly once. A worker's samples *count* once a meeting carried them into
the shared state: every step for ``sync``, every exchange for the periodic strategies, and
every epoch's end. After a loss the rest of the epoch is dealt again over the workers left:
first what the lost workers read since their work last counted (their shards of those
steps, from every plan since), then the steps nobody started. Each worker keeps its own
per-worker batch (``--batch-size``; with ``--global-batch-size`` the global batch is kept
instead), so the global batch shrinks with the world and an epoch takes more steps; the
learning rate is not rescaled, and its schedule follows the share of the epochs trained,
not the count of steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from shoal.core.membership import MembershipChanged
from shoal.core.stop import Leaving, leave_requested, request_stop
from shoal.data import EpochPlan
from shoal.train.membership.changes import MembershipChange, membership_change, resumed_change
from shoal.train.membership.context import LoopContext
from shoal.train.membership.resume import SavedPlan, go_on
from shoal.train.membership.samples import cut_after, record_samples, samples_file, say_held
from shoal.train.membership.tracker.joins import Joins
from shoal.train.optim import schedule_at

_Step = TypeVar("_Step")


@dataclass
class Reading:
    """A plan of this epoch whose steps from ``start`` to ``end`` (``None``: the steps done
    so far) have not counted yet; ``members``: the workers' ids, in rank order."""

    plan: EpochPlan
    order: torch.Tensor
    members: list[int]
    start: int
    end: int | None = None


@dataclass
class Count:
    """What a count carried: steps ``lo`` to ``hi`` of each reading (``ranges``), samples of
    ``epoch``, counted after the run's ``step``."""

    epoch: int
    step: int
    ranges: list[tuple[Reading, int, int]]


class Elastic(Joins):
    """The trainer's side of elastic membership; a no-op without ``--elastic``."""

    def __init__(self, trainer: LoopContext) -> None:
        self.t = trainer
        self.membership = trainer.comm.membership
        self.changes: list[MembershipChange] = []  # summary.json's "membership_changes"
        self._updating = False  # this step's local update is done (a periodic exchange runs)
        self._next: EpochPlan | None = None  # the rest of the epoch, dealt anew
        self._uncounted: list[Reading] = []
        self._trained: list[torch.Tensor] = []  # this worker's samples since they last counted
        self._last: Count | None = None  # the last count that carried any step
        self._record: Path | None = None
        self._steps = trainer.plan.steps_per_epoch  # an epoch's steps for the schedule
        self._resized = False  # the group changed: the schedule follows the epochs' share
        self._joined = False  # a joiner's first epoch goes on from the plan it took over
        self._joining: tuple[int, MembershipChange] | None = None  # a join, and where
        self._resumed = False  # the first epoch goes on from the checkpoint's plan
        self._carried = 0  # resumed inside a round: the steps since the last count
        self._early: list[int] = []
        self.stopped_job = False  #: its leave stopped the job: it was the last worker
        saved = trainer.checkpointer.saved_plan
        if saved is not None:  # --resume
            self._go_on(saved)
        if self.membership is None:
            return
        self.membership.listeners.append(self._changed)
        self._record = samples_file(trainer.cfg, self.membership.me)
        trainer.checkpointer.elastic_part = self._checkpoint_part
        if saved is not None and self.membership.rank == 0:  # before any worker counts
            cut_after(trainer.cfg, trainer.state.step)
        # Workers lost while the trainers were built (a meeting of theirs re-formed the
        # group before this listened): left at the first epoch's start like any loss.
        self._early = [m for m in range(self.membership.first_world)
                       if m not in self.membership.members] \
            if self.membership.me < self.membership.first_world else []
        if self._early:
            trainer.regroup()

    @contextmanager
    def updating(self) -> Iterator[None]:
        """The strategy's step: the local update is done when its exchange meets."""
        self._updating = True
        try:
            yield
        finally:
            self._updating = False

    def _go_on(self, saved: SavedPlan) -> None:
        """``--resume``: the checkpoint's plan of the epoch (on another number of workers,
        its rest dealt over those there are now) and the membership changes so far."""
        t, st = self.t, self.t.state
        world = t.comm.world_size
        went = go_on(saved, len(t.data.train), t.cfg.global_batch(world), world, t.cfg.seed,
                     st.epoch, st.epoch_step)
        if went is not None:
            plan, st.epoch_step = went
            t.install_plan(plan, t.comm.rank)
            self._resumed = True
        own = t.checkpointer.own_part or {}
        if saved.world == world and own.get("elastic"):  # steps not counted yet: they count
            self._trained = list(own["elastic"]["trained"])  # at the next meeting
            self._carried = len(self._trained)
        left = self._left() if st.epoch < t.cfg.epochs else 0
        change = resumed_change(saved.world, world, st.step, st.epoch, left, t.comm.rank == 0)
        self.changes = saved.changes + ([change] if change else [])
        self._resized = bool(self.changes)  # the steps no longer count the epochs' share
        if self._resized:
            self._follow_share()
            t.recorder.changes = self.changes

    def start_epoch(self) -> None:
        """A new epoch: dealt over the workers there are now (from the step resumed at)."""
        t = self.t
        if self._joined:
            self._joined = False
            return
        resumed, self._resumed = self._resumed, False
        if (t.plan.order is not None or t.plan.world != t.comm.world_size) \
                and not self._early and not resumed:
            t.install_plan(EpochPlan(len(t.data.train), t.cfg.global_batch(t.comm.world_size),
                                     t.comm.world_size, t.cfg.seed), t.comm.rank)
        if self.membership is None:
            return
        st = t.state
        self._uncounted = [Reading(t.plan, t.plan.permutation(st.epoch),  # resumed: from the
                                   list(self.membership.members),  # steps not counted yet
                                   st.epoch_step - self._carried)]
        self._carried = 0
        if self._early:  # the rest of the epoch (all of it, unless resumed) dealt anew
            lost, self._early = self._early, []
            self._changed(lost, [])

    # -- the loop -----------------------------------------------------------------------------
    def steps_left(self) -> bool:
        """Whether the epoch has a step left; after its last the strategy closes the epoch
        (``end_epoch``), and a worker lost meanwhile may leave steps to take. A change seen
        outside a step (in an evaluation or a checkpoint mid-epoch, in a joiner's handover)
        is settled first: the next step is the rest's, as dealt anew."""
        t = self.t
        if t.state.epoch_step < t.plan.steps_per_epoch and self.membership is not None \
                and self.membership.join_asked:
            if t.strategy.steps_uncounted():  # streamed fragments: all exchanged now, as at
                t.strategy.end_epoch(t.state.epoch)  # an epoch's end, so that all counts
                self.counted()
            if self._all_counted():
                self._admit()
        if self.settle() or t.state.epoch_step < t.plan.steps_per_epoch:
            return True
        t.strategy.end_epoch(t.state.epoch)
        if self.settle():
            return True
        self.counted()
        return False

    def step(self, train_step: Callable[[Any], _Step]) -> _Step:
        """``train_step`` on the next batch; a worker lost in the step's all-reduce
        (``sync``) leaves the step untaken: it is taken on the rest of the epoch, dealt
        over the workers left."""
        while True:
            try:
                return train_step(self.t.batches)
            except MembershipChanged:
                self.t.strategy.zero_grad()
                self.settle()

    # -- a step -------------------------------------------------------------------------------
    def step_done(self) -> None:
        """After each step: this worker's samples of it, the new plan if the group changed,
        and what counts now."""
        if self.membership is not None:
            self._counts()
        if self._resized:  # the schedule follows the share of the epochs trained
            self._follow_share()

    def _counts(self) -> None:
        """:meth:`step_done` under ``--elastic``: this worker's samples of the step, the
        new plan if the group changed, and what counts now."""
        t, st = self.t, self.t.state
        reading = self._uncounted[-1]
        rank = reading.members.index(self.membership.me)  # in the plan the step was read by
        self._trained.append(reading.plan.local(reading.order, st.epoch_step - 1, rank)[0])
        self.settle()
        if t.strategy.meets_after(st.step):  # streamed fragments: through the oldest's exchange
            self.counted(st.step - t.strategy.steps_uncounted())
            if not t.comm.active:  # alone: no vote tells it of a joiner
                self.membership.look_for_joiners()
            if leave_requested():
                self._leave()

    def _leave(self) -> None:
        """SIGTERM to ``shoal join``: this worker leaves right after a meeting, its work so
        far counted (streamed fragments: what has not counted is dealt again, as a lost
        worker's), and its ``shoal join`` says why in the store; the last worker left stops
        the job instead, as a SIGTERM to it would."""
        if not self.t.comm.active:
            request_stop()
            self.stopped_job = True
            return
        raise Leaving(self.t.state.step)

    def _checkpoint_part(self) -> dict[str, Any]:
        """This worker's samples of the steps that have not counted yet, for a checkpoint
        (inside a round of the periodic strategies; they count at the next meeting)."""
        return {"trained": list(self._trained)}

    def _follow_share(self) -> None:
        """Put the schedule at the share of the epochs trained, not the count of steps."""
        t, steps = self.t, self._steps
        share = 1 - self._left() / len(t.data.train)
        schedule_at(t.scheduler, t.state.epoch * steps + round(steps * share))

    def _left(self) -> int:
        """Samples of the epoch's plan not read yet."""
        plan, step = self.t.plan, self.t.state.epoch_step
        return plan.n - plan.bounds[step][0] if step < plan.steps_per_epoch else 0

    def counted(self, through: int | None = None) -> None:
        """A meeting carried every worker's work so far into the shared state; or, where
        fragments of the model are exchanged at different steps (``--fragments``,
        ``--overlap-steps``), that of the steps up to the run's step ``through``."""
        if self.membership is None:
            return
        t, st = self.t, self.t.state
        take = len(self._trained) if through is None else through - (st.step - len(self._trained))
        if through is not None and take < len(self._trained):
            self._counted_part(take, through)
            return
        ranges = [(r, r.start, st.epoch_step if r.end is None else r.end) for r in self._uncounted]
        if any(lo < hi for _, lo, hi in ranges):
            self._last = Count(st.epoch, st.step, ranges)
        self._uncounted = [Reading(t.plan, t.plan.permutation(st.epoch),
                                   list(self.membership.members), st.epoch_step)]
        if self._record is not None and self._trained:
            record_samples(self._record, {st.epoch: torch.cat(self._trained)}, st.step)
        self._trained = []

    def _counted_part(self, take: int, through: int) -> None:
        """The first ``take`` of the steps not counted yet count (after the run's step
        ``through``); the rest do not yet."""
        if take <= 0:
            return
        st, ranges, keep, left = self.t.state, [], [], take
        for r in self._uncounted:
            end = st.epoch_step if r.end is None else r.end
            n = min(end - r.start, left)
            left -= n
            ranges.append((r, r.start, r.start + n))
            if r.start + n < end or r.end is None:
                keep.append(replace(r, start=r.start + n))
        self._last, self._uncounted = Count(st.epoch, through, ranges), keep
        if self._record is not None:
            record_samples(self._record, {st.epoch: torch.cat(self._trained[:take])}, through)
        self._trained = self._trained[take:]

    def settle(self) -> bool:
        """Install the rest of the epoch dealt anew after a change, if any; returns whether
        it has steps to take."""
        plan, self._next = self._next, None
        if plan is None:
            return False
        t = self.t
        t.install_plan(plan, t.comm.rank)
        t.state.epoch_step = 0
        self._uncounted.append(Reading(plan, plan.permutation(0), list(self.membership.members), 0))
        return plan.steps_per_epoch > 0

    # -- a change -----------------------------------------------------------------------------
    def _changed(self, lost: list[int], ranks: list[int]) -> None:
        """The group was re-formed without ``lost``: deal the rest of the epoch anew."""
        t, st = self.t, self.t.state
        t.regroup()
        t.recorder.take_over(st)  # worker 0 lost: the lowest id left writes the records
        if not self._uncounted:  # no epoch begun yet: left at the first one's start
            self._early += lost
            return
        self._record_lost(lost)
        self._resized = True
        current = self._uncounted[-1]
        world = t.comm.world_size
        if self._next is None and len(self._uncounted) == 1 \
                and current.start >= current.plan.steps_per_epoch:
            # Between two epochs (in the evaluation, the records, the checkpoint): all of the
            # last counted, none of the next begun; its start deals it over the workers left.
            # counted only; after the last epoch none is left
            order = torch.arange(len(t.data.train) if st.epoch < t.cfg.epochs else 0)
        else:
            order = self._rest(current, lost)
            self._next = EpochPlan(len(order), t.cfg.global_batch(world), world, t.cfg.seed, order)
        if not lost:
            return
        why = {m: self.membership.reason(m) for m in lost}
        self.changes.append(membership_change(st.step, st.epoch, why, world, len(order),
                                              say=t.comm.rank == 0))
        t.recorder.changes = self.changes

    def _rest(self, current: Reading, lost: list[int]) -> torch.Tensor:
        """The rest of the epoch after a change: what ``lost`` read since their work last
        counted, then the steps nobody started. The run's count of samples trained drops the
        dealt-again ones: they count when they are trained again."""
        if self._next is not None:  # changed again before the last change was settled
            tail = self._next.order
        else:
            current.end = self.t.state.epoch_step + (1 if self._updating else 0)
            tail = current.plan.rest(current.order, current.end)
        parts = []
        for reading in self._uncounted:
            ranks_there = [reading.members.index(m) for m in lost if m in reading.members]
            parts += reading.plan.lost_shards(reading.order, range(reading.start, reading.end),
                                              ranks_there)
        self.t.state.samples -= sum(len(p) for p in parts)
        return torch.cat([*parts, tail])

    def _record_lost(self, lost: list[int]) -> None:
        """Worker 0 (``--record-samples``): each lost worker's samples of the last count,
        which its vote carried into the shared state, written for it unless it wrote them
        itself before it was lost (:mod:`shoal.train.membership.samples`)."""
        last, m = self._last, self.membership
        if last is None or self._record is None or m.rank != 0:
            return
        for worker in lost:
            parts = [shard for r, lo, hi in last.ranges if worker in r.members
                     for shard in r.plan.lost_shards(r.order, range(lo, hi), [r.members.index(worker)])]
            path = samples_file(self.t.cfg, worker)
            if parts and path is not None and not record_samples(
                    path, {last.epoch: torch.cat(parts)}, last.step, by=m.me, wait=m.timeout):
                say_held(worker, f"step {last.step}")

    def take_over(self, order: torch.Tensor, state: dict[str, Any]) -> None:
        """A joiner: the rest of the epoch (``order``) dealt over its new group, and
        :meth:`handover_state`'s ``state``."""
        t, world = self.t, self.t.comm.world_size
        self._steps, self._resized, self._joined = state["steps"], state["resized"], True
        self.changes, self._joining = list(state["changes"]), state["joining"]
        t.install_plan(EpochPlan(len(order), t.cfg.global_batch(world), world, t.cfg.seed, order),
                       t.comm.rank)
        self._uncounted = [Reading(t.plan, order, list(self.membership.members), 0)]

