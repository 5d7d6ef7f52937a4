"""Who trains what in an asynchronous run under ``--elastic``: each worker's
:class:`Schedule`, and a lost worker's unfinished part dealt over the workers left.

An asynchronous worker never waits for another, so the workers are at different steps and
even different epochs when one is lost. Every epoch is therefore planned once, over the
job's first ``W`` workers (*slots*: the usual :class:`~shoal.data.EpochPlan`), and what a
worker trains is a list of *segments*, ``(epoch, slot, lo, hi)``: samples ``lo`` to ``hi``
of slot ``slot``'s shard of epoch ``epoch``. A worker's schedule starts as its own shard of
every epoch, one *block* per epoch it trains; it is walked in order, so a single count, the
samples whose work reached the servers (a push *counts*), says what is done. When a worker
is lost, its schedule from that count on is cut, epoch by epoch, into even contiguous shares
for the workers left, in the order of their ids; a worker takes its share (*adopts* it) at
a position it reports first: the shares of its current and earlier epochs at once, those
of later epochs at the end of those epochs. Server 0 and the workers hold the same
schedules and apply the same adoptions, so server 0 knows what a lost worker left.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

import torch

from shoal.data import EpochPlan
from shoal.data.sharding import split_sizes

#: ``(epoch, slot, lo, hi)``: samples ``lo`` to ``hi`` of slot ``slot``'s shard of ``epoch``.
Segment = tuple[int, int, int, int]


class Slots:
    """The shards of every epoch's plan over the job's first ``world`` workers."""

    def __init__(self, n: int, global_batch: int, world: int, seed: int) -> None:
        self.plan = EpochPlan(n, global_batch, world, seed)
        order = torch.arange(n)
        self.sizes = [sum(len(self.plan.local(order, s, w)[0])
                          for s in range(self.plan.steps_per_epoch)) for w in range(world)]
        self.shard = lru_cache(maxsize=4 * world)(self._shard)

    def _shard(self, epoch: int, slot: int) -> torch.Tensor:
        perm = self.plan.permutation(epoch)
        return torch.cat([self.plan.local(perm, s, slot)[0]
                          for s in range(self.plan.steps_per_epoch)])

    def samples(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sample indices of ``segments``, in order, and the epoch of each."""
        parts = [self.shard(e, w)[lo:hi] for e, w, lo, hi in segments]
        epochs = [torch.full((hi - lo,), e, dtype=torch.long) for e, _, lo, hi in segments]
        empty = torch.zeros(0, dtype=torch.long)
        return (torch.cat(parts) if parts else empty, torch.cat(epochs) if epochs else empty)


def slots_of(cfg: Any, n: int, workers: int) -> Slots:
    """The plan every epoch is dealt from: over the job's first ``workers`` workers."""
    return Slots(n, cfg.global_batch(workers), workers, cfg.seed)


def length(segments: list[Segment]) -> int:
    """The samples of ``segments``."""
    return sum(hi - lo for _, _, lo, hi in segments)


def cut(segments: list[Segment], at: int) -> tuple[list[Segment], list[Segment]]:
    """``segments`` split after their first ``at`` samples."""
    head: list[Segment] = []
    for i, (e, w, lo, hi) in enumerate(segments):
        if at <= 0:
            return head, segments[i:]
        if at < hi - lo:
            return head + [(e, w, lo, lo + at)], [(e, w, lo + at, hi)] + segments[i + 1:]
        head.append((e, w, lo, hi))
        at -= hi - lo
    return head, []


class Schedule:
    """What one worker trains: ``blocks[e]``, the segments it trains in its epoch ``e``: its
    slot's shard, or (a compute group of ``members`` workers from ``worker``, walked by all
    of them together) its members' shards one after the other."""

    def __init__(self, slots: Slots, worker: int, epochs: int, members: int = 1) -> None:
        self.blocks: list[list[Segment]] = [
            [(e, w, 0, slots.sizes[w]) for w in range(worker, worker + members)]
            for e in range(epochs)]

    @classmethod
    def empty(cls, epochs: int) -> Schedule:
        """A joiner's: nothing of its own, every block filled by what it is given."""
        schedule = cls.__new__(cls)
        schedule.blocks = [[] for _ in range(epochs)]
        return schedule

    def start(self, epoch: int) -> int:
        """The samples of the blocks before ``epoch``."""
        return sum(length(b) for b in self.blocks[:epoch])

    def epoch_at(self, done: int) -> int:
        """The block the sample after the first ``done`` is in (the last once all are)."""
        for e, block in enumerate(self.blocks):
            done -= length(block)
            if done < 0:
                return e
        return len(self.blocks) - 1

    def rest(self, done: int) -> list[Segment]:
        """Every segment after the first ``done`` samples."""
        out: list[Segment] = []
        for block in self.blocks:
            head, tail = cut(block, done)
            done -= length(head)
            out += tail
        return out

    def adopt(self, epoch: int, offset: int, pieces: list[Segment]) -> None:
        """Take ``pieces`` in block ``epoch`` after its first ``offset`` samples: those of
        this epoch and earlier ones there, the later ones at the end of their blocks."""
        now = [p for p in pieces if p[0] <= epoch]
        head, tail = cut(self.blocks[epoch], offset)
        self.blocks[epoch] = head + now + tail
        for p in pieces:
            if p[0] > epoch:
                self.blocks[p[0]].append(p)

    def give(self, epoch: int, offset: int, parts: int) -> list[Segment]:
        """Hand a joiner the last ``1/parts`` of the rest of every block from block
        ``epoch``'s ``offset``-th sample on (rounded down: a rest of one sample is kept)."""
        given: list[Segment] = []
        for e in range(epoch, len(self.blocks)):
            head, tail = cut(self.blocks[e], offset if e == epoch else 0)
            kept, gone = cut(tail, length(tail) - length(tail) // parts)
            self.blocks[e] = head + kept
            given += gone
        return given


def deal(unfinished: list[Segment], workers: list[int]) -> dict[int, list[Segment]]:
    """``unfinished`` cut, epoch by epoch (in order), into even contiguous shares for
    ``workers`` (in the order of their ids)."""
    workers = sorted(workers)
    shares: dict[int, list[Segment]] = {w: [] for w in workers}
    for epoch in sorted({s[0] for s in unfinished}):
        rest = [s for s in unfinished if s[0] == epoch]
        for w, size in zip(workers, split_sizes(length(rest), len(workers)), strict=True):
            share, rest = cut(rest, size)
            shares[w] += share
    return shares


def shard_rows(plan: EpochPlan, rows: int, worker: int, steps: int) -> int:
    """Rows of ``worker``'s shard in its first ``steps`` steps (the plan fixes them)."""
    per_epoch = plan.steps_per_epoch
    order = torch.arange(rows)
    sizes = [len(plan.local(order, s, worker)[0]) for s in range(per_epoch)]
    full, rest = divmod(steps, per_epoch)
    return full * sum(sizes) + sum(sizes[:rest])


def loss_record(plan: EpochPlan, rows: int, epochs: int, who: tuple[int, int], step: int,
                info: dict[str, Any], since: float) -> dict[str, Any]:
    """Server 0's record of lost worker ``who`` (its id and rank) at its ``step``: what of
    its shards it trained and did not (``since``: the run's start, a UNIX time)."""
    worker, rank = who
    known = worker < plan.world  # a worker that joined has no shard of its own
    trained = shard_rows(plan, rows, worker, step) if known else 0
    total = shard_rows(plan, rows, worker, plan.steps_per_epoch * epochs) if known else 0
    return {"worker": worker, "rank": rank,
            "lost_after_s": max(0.0, float(info.get("time", time.time())) - since),
            "step": step, "samples_trained": trained, "samples_not_trained": total - trained,
            "error": str(info.get("error", ""))}
