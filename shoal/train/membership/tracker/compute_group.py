"""``groups`` under ``--elastic``: a compute group re-formed in place from its members alive.

A compute group's collectives (DDP's all-reduce of the gradients, the leader's broadcast of
the parameters and of the deals it read, the idle look at the end) are meetings of a
:class:`~shoal.core.membership.Membership` of the group's own (its keys under
``elastic/group/<first>``), as a ``sync`` job's are of the job's. A member is gone once
server 0 says so (:func:`gone_key`): it judges every worker of the job, through its pairs,
within the heartbeat timeout, under any launcher. A meeting a member lost fails on the
others; the members alive agree on who is left, join a new process group and go on:

- the group batch stays what it was (the servers see the same group gradient, the step's
  learning rate is the same), split over the members left, from the step that failed on
  (:class:`~shoal.train.membership.tracker.detached.AsyncElastic` plans its rest anew);
- a member lost deals nothing at server 0: its group walks its schedule on; the leader
  tells server 0 the rows the member trained in the blocks it never reported;
- the leader lost: the first member alive takes its place at the servers (it pushes for
  the group from then on, records its samples, and tells server 0 the shares the group
  took and the parts it gave, which the leader may not have told), where server 0's count
  of the leader is the group's. A leader lost in its exchange (server 0 may not have
  applied it) takes the group out instead: its members leave, and server 0 deals the
  group's rest from its count over the other groups. Server 0 deals a group's rest only
  once its last member is lost.
"""

from __future__ import annotations

from typing import Any

from shoal.core.group import bound_waits, own_client
from shoal.core.membership import Membership
from shoal.core.waits import ELASTIC
from shoal.data.sharding import shard_range
from shoal.strategies.asynchronous import AsyncStrategy
from shoal.strategies.groups import ComputeGroups
from shoal.train.membership.messages import Rows, encode


def gone_key(worker: int) -> str:
    """Where server 0 says that ``worker`` is lost to the job (its pairs broke)."""
    return f"{ELASTIC}/async/gone/{worker}"


def leader_lost(first: int, end: int) -> str:
    """Why a member of the compute group ``[first, end)`` left when it lost its leader."""
    return f"left: its compute group (workers {first}-{end - 1}) lost its leader (worker {first})"


def grouped(strategy: AsyncStrategy) -> ComputeGroups:
    """``strategy``, a compute group's of several workers, typed so.

    Raises:
        TypeError: it is not ``groups`` (only its workers train as a group).
    """
    if not isinstance(strategy, ComputeGroups):
        raise TypeError(f"{type(strategy).__name__} trains no compute group")
    return strategy


def group_membership(comm: Any, group: Any, bounds: tuple[int, int], me: int, cfg: Any,
                     attempt: int) -> Membership:
    """Make the compute group ``bounds`` (``[first, end)``) that ``group`` (its Comm,
    joined) speaks for elastic: its meetings voted on in ``comm``'s store (the worker's, the
    job's under the attempt's prefix), a collective bounded by the heartbeat timeout (a
    member silent that long is gone), a member gone once server 0 says so."""
    wait = min(cfg.heartbeat_timeout, cfg.timeout)
    bound_waits(wait)
    membership = Membership.of_group(group, comm.attempt_store, list(range(*bounds)), me,
                                     gone_key, wait, cfg.timeout,
                                     lambda: own_client(comm.store, attempt))
    group.membership = membership
    return membership


class Seat:
    """A worker's place in its compute group (``[first, end)``) under ``--elastic``: the
    group's members as last formed (its size, this worker's index), those the current plan
    is split over (:meth:`planned`), and the rows each member trained in each block (kept
    by every member: any may come to lead). A member lost mid-block never reports that
    block, so the leader tells server 0 its rows of it (:meth:`tell_lost`) for the job's
    count of samples. A member that takes a lost leader's place is the group's
    :attr:`first` from then on."""

    def __init__(self, strategy: AsyncStrategy, me: int, first: int, end: int) -> None:
        self.strategy, self.me, self.first, self.end = strategy, me, first, end
        self.members = self.split = list(range(first, end))
        self.moved = False  #: re-formed since the rest was planned: plan it anew
        self.rows: dict[int, dict[int, int]] = {}  # member -> block -> rows
        self.lost: list[int] = []  # members lost, not told to server 0 yet
        #: the leader lost at the last re-forming, whose place is not taken yet
        self.orphaned: int | None = None
        if self.size > 1:
            self._membership().listeners.append(self._regrouped)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def index(self) -> int:
        return self.members.index(self.me)

    def _regrouped(self, lost: list[int], ranks: list[int]) -> None:
        """The group was re-formed without ``lost`` (its leader too, maybe)."""
        self.members, self.moved = list(self._membership().members), True
        self.lost += lost
        if self.first in lost:
            self.orphaned = self.first
        self.strategy.regroup()

    def _membership(self) -> Membership:
        """The compute group's membership (:func:`group_membership`'s)."""
        membership = grouped(self.strategy).group.membership
        if membership is None:
            raise TypeError("this compute group is not elastic")
        return membership

    def planned(self) -> None:
        """The rest was planned over the group as it is now."""
        self.moved, self.split = False, list(self.members)

    def read(self, rows: int, block: int) -> None:
        """A group batch of ``rows`` of ``block`` trained, each member its part."""
        if len(self.split) == 1:
            return
        for i, member in enumerate(self.split):
            lo, hi = shard_range(rows, len(self.split), i)
            mine = self.rows.setdefault(member, {})
            mine[block] = mine.get(block, 0) + hi - lo

    def tell_lost(self, client: Any) -> None:
        """The leader: tell server 0 each lost member's rows of each block."""
        for member in self.lost:
            rows = self.rows.pop(member, {})
            if self.me == self.first:
                client.report(encode(Rows(member, self.first, rows)))
        self.lost = []


__all__ = ["Seat", "gone_key", "group_membership", "grouped", "leader_lost"]
