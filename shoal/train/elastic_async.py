"""``--elastic`` for the asynchronous strategies: a lost worker's unfinished work is dealt
over the workers left, so that every sample of every epoch is trained exactly once.

A worker's samples *count* once an exchange carried their work to the servers and server 0
applied it (a pushed gradient; the elastic strategies' ``x``, sent before the local step,
carries the steps before it; at its end a worker makes one more exchange for the steps
after its last). Each exchange says how many samples of the worker's schedule
(:mod:`shoal.train.deal`) it carries, and server 0 keeps the count of the last one applied.
When a worker is lost, server 0's :class:`Dealer` deals the rest of its schedule over the
workers left and publishes the deal in the job's store; each worker looks for new deals
between its steps (every 50 ms at most), reports where it takes its share, and trains it.
A worker that has trained its schedule waits for server 0 to release it: a worker lost
later may still leave it work. Nobody waits for anybody otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from shoal.core.processes import stop_requested
from shoal.core.waits import ELASTIC, publish_members
from shoal.data import EpochPlan, ShardLoader, resolve_workers
from shoal.train.deal import Schedule, Segment, Slots, cut, deal
from shoal.train.elastic import membership_change
from shoal.train.optim import schedule_at
from shoal.train.samples import record_since, samples_file, say_held

_Step = TypeVar("_Step")
DEALS = f"{ELASTIC}/async/deals"  #: how many deals server 0 published
RELEASE = f"{ELASTIC}/async/release"  #: set once no worker has work left
#: Seconds between two looks for a new deal.
POLL_S = 0.05
#: Seconds between two reports of a worker waiting for its release (a dead server 0 is
#: seen by the report, which has its timeout).
IDLE_REPORT_S = 5.0


def deal_key(n: int) -> str:
    return f"{ELASTIC}/async/deal/{n}"


def slots_of(cfg: Any, n: int, workers: int) -> Slots:
    """The plan every epoch is dealt from: over the job's first ``workers`` workers."""
    return Slots(n, cfg.global_batch(workers), workers, cfg.seed)


class AsyncElastic:
    """A detached worker's side: it walks its :class:`Schedule` block by block (one a
    trainer epoch, in batches of its share of the global batch), takes the shares dealt to
    it, records its samples as they count (``--record-samples``) and, at its end, waits
    for server 0's release. Same interface as :class:`~shoal.train.elastic.Elastic`."""

    def __init__(self, trainer: Any) -> None:
        t = self.t = trainer
        self.store, self.me = t.comm.attempt_store, t.comm.rank
        workers = t.comm.world_size
        self.slots = slots_of(t.cfg, len(t.data.train), workers)
        self.schedule = Schedule(self.slots, self.me, t.cfg.epochs)
        self.batch = max(1, t.cfg.global_batch(workers) // workers)
        self.seen = 0  # deals read
        self.polled = 0.0
        self.offset = 0  # samples of this block before the current plan
        self.epochs = torch.zeros(0, dtype=torch.long)  # the current plan's samples' epochs
        self.trained: list[tuple[torch.Tensor, torch.Tensor]] = []  # (epochs, samples), uncounted
        self.at = 0  # the schedule position of self.trained's first sample
        self.record = samples_file(t.cfg, self.me)
        self.steps = t.plan.steps_per_epoch  # an epoch's steps for the schedule
        self.dealt = False  # a share was taken: the schedule follows the blocks' share read

    @contextmanager
    def updating(self) -> Iterator[None]:
        yield

    def step(self, train_step: Callable[[Any], _Step]) -> _Step:
        return train_step(self.t.batches)

    def start_epoch(self) -> None:
        self._plan(0)

    def _plan(self, offset: int) -> None:
        """The rest of this block, from its ``offset``-th sample, as the trainer's plan."""
        t = self.t
        self.offset = offset
        order, self.epochs = self.slots.samples(cut(self.schedule.blocks[t.state.epoch],
                                                    offset)[1])
        t.plan = EpochPlan(len(order), self.batch, 1, t.cfg.seed, order)
        t.loader.close()
        t.loader = ShardLoader(t.data, t.plan, 0,
                               resolve_workers(t.cfg.loader_workers, t.data.train),
                               pin_memory=t.device.type == "cuda", seed=t.cfg.seed)
        t.recorder.plan = t.checkpointer.plan = t.plan
        t.state.epoch_step = 0
        t.batches = t.loader.epoch(t.state.epoch, 0)

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
        lo, hi = t.plan.bounds[t.state.epoch_step - 1]
        self.trained.append((self.epochs[lo:hi], t.plan.order[lo:hi]))
        self._count()
        if time.monotonic() - self.polled >= POLL_S:
            self._poll()
        if self.dealt:  # the share of this epoch's block read, not the count of steps
            block = sum(b - a for _, _, a, b in self.schedule.blocks[t.state.epoch])
            read = min(self._read() / block, 1.0) if block else 1.0
            schedule_at(t.scheduler, t.state.epoch * self.steps + round(self.steps * read))

    def _count(self) -> None:
        """Record the samples whose work reached the servers (the strategy's count)."""
        counted, done = self.t.strategy.counted, {}
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

    # -- deals --------------------------------------------------------------------------------
    def _poll(self) -> tuple[bool, bool]:
        """Take the deals published since the last look: (any new, any share for me)."""
        self.polled = time.monotonic()
        published = self.store.add(DEALS, 0)
        new, mine = published > self.seen, False
        while self.seen < published:
            self.seen += 1
            shares = json.loads(self.store.get(deal_key(self.seen)))["shares"]
            pieces: list[Segment] = [tuple(p) for p in shares.get(str(self.me), [])]  # type: ignore[misc]
            if pieces:
                self._adopt(self.seen, pieces)
                mine = True
        return new, mine

    def _adopt(self, n: int, pieces: list[Segment]) -> None:
        """Take deal ``n``'s ``pieces`` where this worker is, told to server 0 first."""
        t, offset = self.t, self._read()
        t.comm.ps.report({"kind": "adopt", "deal": n, "epoch": t.state.epoch, "offset": offset})
        self.schedule.adopt(t.state.epoch, offset, pieces)
        self._plan(offset)
        self.dealt = True

    def _wait_for_release(self) -> bool:
        """At the end: send the last work, say so, and wait for a share (``True``) or the
        release (``False``); SIGTERM ends the wait (the run stops)."""
        t = self.t
        t.strategy.flush()
        self._count()
        said = 0.0
        while not self.store.check([RELEASE]) and not stop_requested():
            new, mine = self._poll()
            if mine:
                t.strategy.rejoin()
                return True
            if new or time.monotonic() - said > IDLE_REPORT_S:
                t.comm.ps.report({"kind": "idle", "deals": self.seen})
                said = time.monotonic()
            time.sleep(POLL_S)
        return False


class Dealer:
    """Server 0's side: every worker's schedule (as it adopts shares), a lost worker's
    rest dealt over the live ones and published, the release once all are idle."""

    def __init__(self, cfg: Any, store: Any, n: int, workers: int, servers: int) -> None:
        self.store, self.cfg, self.servers = store, cfg, servers
        self.slots = slots_of(cfg, n, workers)
        self.schedules = {w: Schedule(self.slots, w, cfg.epochs) for w in range(workers)}
        self.deals: list[dict[int, list[Segment]]] = []
        self.adopted: dict[int, set[int]] = {w: set() for w in range(workers)}
        self.idle: dict[int, int] = {}  # worker -> deals it had read when it said idle
        self.changes: list[dict[str, Any]] = []
        self.released = False

    def take(self, worker: int, report: dict[str, Any]) -> None:
        """A worker's ``adopt`` or ``idle`` report."""
        if report["kind"] == "adopt":
            n = int(report["deal"])
            self.schedules[worker].adopt(int(report["epoch"]), int(report["offset"]),
                                         self.deals[n - 1][worker])
            self.adopted[worker].add(n)
            self.idle.pop(worker, None)
        else:
            self.idle[worker] = int(report["deals"])

    def lost(self, worker: int, info: dict[str, Any], live: set[int], why: Callable[[], str]
             ) -> int:
        """Deal what ``worker`` left (after its ``info["counted"]`` samples, and the shares
        it never took) over ``live``; the samples dealt."""
        counted = int(info.get("counted", 0))
        self._record_lost(worker, counted)
        rest = self.schedules[worker].rest(counted)
        for n, shares in enumerate(self.deals, 1):
            if n not in self.adopted[worker]:
                rest += shares.get(worker, [])
        dealt = sum(hi - lo for _, _, lo, hi in rest)
        self.idle.pop(worker, None)
        if not live:
            return 0
        if not self.released:
            shares = deal(rest, sorted(live))
            self.deals.append(shares)
            self.store.set(deal_key(len(self.deals)), json.dumps(
                {"lost": worker, "shares": {str(w): s for w, s in shares.items()}}))
            self.store.add(DEALS, 1)
            publish_members(self.store, f"async{len(self.deals)}",
                            [*range(self.servers), *(self.servers + w for w in sorted(live))])
        epochs = [e for e, _, _, _ in rest] or [self.cfg.epochs - 1]
        self.changes.append(membership_change(int(info.get("step", 0)), min(epochs),
                                              {worker: why()}, len(live), dealt,
                                              last=max(epochs)))
        return dealt

    def _record_lost(self, worker: int, counted: int) -> None:
        """``--record-samples``: ``worker``'s samples up to its last count that server 0
        applied, written for it unless it wrote them (lost after the push, before its line)."""
        path = samples_file(self.cfg, worker)
        if path is None or counted <= 0:
            return
        walk = [s for block in self.schedules[worker].blocks for s in block]

        def since(last: int) -> dict[int, torch.Tensor]:
            samples, epochs = self.slots.samples(cut(cut(walk, counted)[0], last)[1])
            return {e: samples[epochs == e] for e in sorted(epochs.unique().tolist())}

        if not record_since(path, counted, since, "server 0", wait=self.cfg.heartbeat_timeout):
            say_held(worker, "its last count")

    def release(self, live: set[int]) -> None:
        """Release the workers once every live one is idle with every deal read."""
        if not self.released and live and all(self.idle.get(w) == len(self.deals) for w in live):
            self.store.set(RELEASE, "1")
            self.released = True


__all__ = ["AsyncElastic", "Dealer"]
