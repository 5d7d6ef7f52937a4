"""A join's side of a synchronous or periodic ``--elastic`` run (:class:`Joins`, a part of
:class:`~shoal.train.membership.tracker.process_group.Elastic`): a worker that asked to join
(``shoal join``) is admitted at a meeting where all work so far counts, the rest of the epoch
is dealt over the grown group, and worker 0 hands it its live state
(:mod:`shoal.train.membership.handover`)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from shoal.core.admission import admit
from shoal.core.membership import Membership
from shoal.data import EpochPlan
from shoal.train.membership import handover
from shoal.train.membership.changes import MembershipChange, joined_change, worker_names
from shoal.train.membership.context import LoopContext

log = logging.getLogger("shoal.membership")


class Joins:
    """:class:`~shoal.train.membership.tracker.process_group.Elastic`'s joins (its trainer ``t``,
    ``membership``, readings and changes; its ``settle`` and ``counted``)."""

    t: LoopContext
    membership: Membership | None
    changes: list[MembershipChange]
    _joining: tuple[int, MembershipChange] | None
    _uncounted: list[Any]  # process_group's Readings (it imports this module)
    _trained: list[torch.Tensor]
    _next: EpochPlan | None
    _steps: int
    _resized: bool

    def _all_counted(self) -> bool:
        """Whether all work so far counts (a meeting point, nothing dealt anew pending)."""
        reading = self._uncounted[-1]
        return (len(self._uncounted) == 1 and reading.start == self.t.state.epoch_step
                and not self._trained and self._next is None)

    def _admit(self) -> None:
        """Workers asked to join (every member saw it in a meeting's decision) and all work
        so far counts: admit them (:mod:`shoal.core.admission`), deal the rest of the epoch
        over the grown group, and hand them worker 0's live state."""
        t, st = self.t, self.t.state
        started = time.perf_counter()
        joined = admit(self.membership, t.cfg.max_workers or self.membership.first_world,
                       t.cfg.timeout)
        self.settle()  # the rest dealt anew (over the joiners too, or without one lost)
        self.counted()
        if not joined:
            return
        # A joiner lost in the handover has its loss recorded after its join: its place kept.
        workers, at = t.comm.world_size, len(self.changes)
        if t.comm.rank == 0:
            log.info(f"shoal: {worker_names(joined)} joined at step {st.step}; {workers} go on with "
                     f"the {t.plan.n} samples left of epoch {st.epoch + 1}")
        change = joined_change(st.step, st.epoch, joined, workers, t.plan.n)
        self._joining = (at, change)  # the joiners keep it too (they may write the records)
        mine, theirs = handover.send(t, self, joined)
        self.joined(mine, theirs, round(time.perf_counter() - started, 4))

    def joined(self, mine: str, theirs: dict[str, str], stall_s: float | None = None) -> None:
        """After a handover (a member's, with its ``stall_s``; a joiner's): the join's
        record with worker 0's digest ``mine`` and the joiners' ``theirs``, in its place
        among the changes (a joiner lost meanwhile has its loss recorded after it)."""
        if self._joining is not None:
            at, change = self._joining
            self.changes.insert(at, replace(change, state_sha256=mine, joiner_state_sha256=theirs,
                                            stall_s=stall_s))
            self._joining = None
        self.t.recorder.changes = self.changes

    def take_over(self, order: torch.Tensor, state: dict[str, Any]) -> None:
        """A joiner: the rest of the epoch (``order``) dealt over its new group, and
        :meth:`handover_state`'s ``state`` (the tracker's own)."""
        raise NotImplementedError

    def handover_state(self) -> dict[str, Any]:
        """What a joiner takes of this worker's side (:mod:`shoal.train.membership.handover`)."""
        return {"steps": self._steps, "resized": self._resized, "changes": list(self.changes),
                "joining": self._joining}


__all__ = ["Joins"]
