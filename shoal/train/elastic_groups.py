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
  (:class:`~shoal.train.elastic_async.AsyncElastic` plans its rest anew);
- a member lost deals nothing at server 0: its group walks its schedule on;
- the leader lost takes the group out (:class:`LeaderLost`): it was the group's end at the
  servers, whose count of the group's work dies with it; its members leave, and server 0
  deals the group's rest from the leader's last exchange over the other groups.
"""

from __future__ import annotations

from typing import Any

from shoal.core.group import bound_waits, own_client
from shoal.core.membership import Membership
from shoal.core.waits import ELASTIC
from shoal.data.sharding import shard_range


def gone_key(worker: int) -> str:
    """Where server 0 says that ``worker`` is lost to the job (its pairs broke)."""
    return f"{ELASTIC}/async/gone/{worker}"


class LeaderLost(Exception):
    """A compute group re-formed without its leader: its members leave."""

    def __init__(self, first: int, end: int) -> None:
        super().__init__(f"left: its compute group (workers {first}-{end - 1}) lost its "
                         f"leader, worker {first}")


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
    """A worker's place in its compute group (``[first, end)``) under ``--elastic``: its
    index and the group's size as last formed, the members the current plan is split over
    (:meth:`planned`), and, on the leader, the rows each member trained in each block. A
    member lost mid-block never reports that block, so the leader tells server 0 its rows
    of it (:meth:`tell_lost`) for the job's count of samples."""

    def __init__(self, strategy: Any, me: int, first: int, end: int) -> None:
        self.strategy, self.me, self.first, self.end = strategy, me, first, end
        self.index, self.size = me - first, end - first
        self.members = self.split = list(range(first, end))
        self.moved = False  #: re-formed since the rest was planned: plan it anew
        self.rows: dict[int, dict[int, int]] = {}  # the leader's: member -> block -> rows
        self.lost: list[int] = []  # members lost, not told to server 0 yet
        if self.size > 1:
            strategy.group.membership.listeners.append(self._regrouped)

    def _regrouped(self, lost: list[int], ranks: list[int]) -> None:
        """The group was re-formed without ``lost``; without its leader it is out."""
        if self.first in lost:
            raise LeaderLost(self.first, self.end)
        group = self.strategy.group
        self.index, self.size, self.moved = group.rank, group.world_size, True
        self.members = list(group.membership.members)
        if self.me == self.first:
            self.lost += lost
        self.strategy.regroup()

    def planned(self) -> None:
        """The rest was planned over the group as it is now."""
        self.moved, self.split = False, list(self.members)

    def read(self, rows: int, block: int) -> None:
        """The leader: a group batch of ``rows`` of ``block`` trained, each member its part."""
        if self.me != self.first or len(self.split) == 1:
            return
        for i, member in enumerate(self.split):
            lo, hi = shard_range(rows, len(self.split), i)
            mine = self.rows.setdefault(member, {})
            mine[block] = mine.get(block, 0) + hi - lo

    def tell_lost(self, client: Any) -> None:
        """The leader: tell server 0 each lost member's rows of each block."""
        for member in self.lost:
            client.report({"kind": "rows", "worker": member, "rows": {
                str(block): n for block, n in self.rows.pop(member, {}).items()}})
        self.lost = []


__all__ = ["LeaderLost", "Seat", "gone_key", "group_membership"]
