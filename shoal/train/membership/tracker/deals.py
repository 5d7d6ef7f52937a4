"""A detached worker's side of server 0's deals under ``--elastic``
(:class:`TakesDeals`, a part of :class:`~shoal.train.membership.tracker.detached.AsyncElastic`): it looks
for new deals between its steps, takes the shares dealt to it and gives a joiner its part,
each told to server 0 before it acts; at its end it waits for a share or the release. The
store keys server 0 publishes them under are here too."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from shoal.core.stop import request_stop, stop_requested
from shoal.core.waits import ELASTIC
from shoal.errors import ShoalError
from shoal.strategies.asynchronous import AsyncStrategy
from shoal.train.membership.context import LoopContext
from shoal.train.membership.handover import digest
from shoal.train.membership.messages import Adopt, Give, Idle, Joined, encode
from shoal.train.membership.schedule import Segment
from shoal.train.membership.tracker.compute_group import grouped
from shoal.train.optim import schedule_at

DEALS = f"{ELASTIC}/async/deals"  #: how many deals server 0 published
RELEASE = f"{ELASTIC}/async/release"  #: set once no worker has work left
#: Seconds between two looks for a new deal.
POLL_S = 0.05
#: Seconds between two reports of a worker waiting for its release (a dead server 0 is
#: seen by the report, which has its timeout).
IDLE_REPORT_S = 5.0


def deal_key(n: int) -> str:
    return f"{ELASTIC}/async/deal/{n}"


def leave_key(worker: int) -> str:
    """Server 0's answer to ``worker`` leaving: ``go``, or ``stop`` (it was the last)."""
    return f"{ELASTIC}/async/leave/{worker}"


class TakesDeals:
    """The deals part of :class:`~shoal.train.membership.tracker.detached.AsyncElastic` (its attributes:
    ``t``, ``store``, ``me``, ``unit``, ``schedule``, ``seen``, ``dealt``, ``seat``...)."""

    t: LoopContext
    strategy: AsyncStrategy  # the trainer's, a detached worker's
    store: dist.Store
    former: tuple[int, ...]  # a compute group's earlier leaders: deals to them are its
    acts: list[Adopt | Give]  # a compute group's shares taken and parts given

    def _published(self) -> int:
        """The deals published, as a compute group's leader tells its group after its
        exchange: read in the store at most every :data:`POLL_S`, as any worker looks."""
        if time.monotonic() - self.looked[0] >= POLL_S:
            self.looked = (time.monotonic(), int(self.store.add(DEALS, 0)))
        return self.looked[1]

    def _poll(self, published: int | None = None) -> tuple[bool, bool]:
        """Take the deals published since the last look (up to ``published``, a compute
        group's agreed count): (any new, any share for me)."""
        self.polled = time.monotonic()
        if published is None:
            published = int(self.store.add(DEALS, 0))
        new, mine = published > self.seen, False
        while self.seen < published:
            self.seen += 1
            record = json.loads(self.store.get(deal_key(self.seen)))
            if record.get("stop"):  # the job was stopped (SIGTERM): a joiner's only word of it
                request_stop()
            give, units = record.get("give"), (self.unit, *self.former)  # a group's ids
            if give is not None and any(u in give["givers"] for u in units):
                self._give(self.seen, int(give["parts"]))
            pieces: list[Segment] = [tuple(p) for u in units  # type: ignore[misc]
                                     for p in record["shares"].get(str(u), [])]
            if pieces or record.get("joined") == self.unit:
                self._adopt(self.seen, pieces)
                mine = True
        return new, mine

    def _give(self, n: int, parts: int) -> None:
        """Give a joiner the last ``1/parts`` of this worker's rest (deal ``n``), from where
        it is, told to server 0 first."""
        t, offset = self.t, self._read()
        self._tell(Give(n, t.state.epoch, offset))
        block = self.schedule.blocks[t.state.epoch]
        if self.schedule.give(t.state.epoch, offset, parts):
            self.dealt = True
            if self.schedule.blocks[t.state.epoch] != block:
                self._plan(offset)  # this block's rest was given in part

    def join(self, epoch: int) -> None:
        """A worker that joined, at ``epoch`` (the records'): say what state it took (the
        center, as its first pull had it) and wait for what it is given."""
        t = self.t
        t.state.epoch, t.state.step = epoch, epoch * self.steps
        schedule_at(t.scheduler, epoch * self.steps)
        self.dealt = True  # its schedule follows the share of each block it reads
        # hogwild's parameters are the shared ones, stepped meanwhile: no copy to digest
        mine = None if self.strategy.shared_memory else digest(
            {"center": self.strategy.flat.pack(), "progress": {}})
        t.comm.ps.report(encode(Joined(mine)))
        deadline = time.monotonic() + t.cfg.timeout
        while not self._poll()[1] and not self.store.check([RELEASE]) and not stop_requested():
            if time.monotonic() > deadline:
                raise ShoalError(f"nothing was given to this worker within --timeout "
                                 f"{t.cfg.timeout:g} s")
            time.sleep(POLL_S)

    def _adopt(self, n: int, pieces: list[Segment]) -> None:
        """Take deal ``n``'s ``pieces`` where this worker is, told to server 0 first."""
        t, offset = self.t, self._read()
        self._tell(Adopt(n, t.state.epoch, offset))
        self.schedule.adopt(t.state.epoch, offset, pieces)
        self._plan(offset)
        self.dealt = True

    def _tell(self, act: Adopt | Give) -> None:
        """Tell server 0 a share taken or a part given (a compute group's leader does), and
        keep it: a member that takes a lost leader's place tells those it may not have."""
        if self.seat.size > 1 or self.former:
            self.acts.append(act)
        if self.me == self.unit:
            self.t.comm.ps.report(encode(act))

    def _wait_for_release(self) -> bool:
        """At the end: send the last work, say so, and wait for a share (``True``) or the
        release (``False``); SIGTERM ends the wait (the run stops)."""
        t = self.t
        self.strategy.flush()
        self._count()
        said = 0.0
        while True:
            published, ended = self._agreed_look()
            self._regrouped()
            if ended:
                break
            new, mine = self._poll(published)
            if mine:
                self.strategy.rejoin()
                return True
            if new or time.monotonic() - said > IDLE_REPORT_S:
                t.comm.ps.report(encode(Idle(self.seen)))
                said = time.monotonic()
            time.sleep(POLL_S)
        return False

    def _agreed_look(self) -> tuple[int | None, bool]:
        """While waiting for the release: the deals to take (``None``: all published) and
        whether the wait is over (released, or SIGTERM); a compute group's members agree on
        both (the least of their counts, every flag), so that they go on together."""
        ended = self.store.check([RELEASE]) or stop_requested()
        if self.seat.size == 1:
            return None, ended
        look = torch.tensor([self.store.add(DEALS, 0), -int(ended)], dtype=torch.int64)
        grouped(self.strategy).group.all_reduce(look, op="min", name="group deals")
        return int(look[0]), bool(look[1])


__all__ = ["DEALS", "IDLE_REPORT_S", "POLL_S", "RELEASE", "TakesDeals", "deal_key", "leave_key"]
