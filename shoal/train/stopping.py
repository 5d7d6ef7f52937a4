"""Stopping every rank after the same step when SIGTERM reaches one of them, or one of
them is told the run collapsed (an asynchronous run's coordinator says so)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.comm import Comm
from shoal.core.stop import stop_requested

SIGTERM = "SIGTERM"
#: A worker told by its coordinator that the run collapsed (never the run's stop line).
COLLAPSED = "collapse"
#: What a vote carries: the index of a rank's reason (the largest wins).
REASONS = (None, SIGTERM, COLLAPSED)


def run_reason(reasons: Iterable[str | None], judged: bool) -> str | None:
    """The reason an asynchronous run stopped, from its workers'. A collapse the coordinator
    ``judged`` too is said by the run's collapse line, not as a reason; one only the workers
    saw (their training at chance, the center's tests not) is the reason."""
    found = [r for r in reasons if r is not None]
    return next((r for r in found if r != COLLAPSED), None if judged or not found else COLLAPSED)


class StopVote:
    """Whether all ranks stop after this step (``stop_requested`` on any of them).

    They vote in a tiny all-reduce on a Gloo group of its own, at the strategy's own meeting
    points (the steps ``meets(step)`` says the workers exchanged after: every ``tau``-th for
    the periodic strategies, so it adds no coupling), and act on a vote one meeting later,
    so nobody waits for it.
    """

    def __init__(self, comm: Comm, meets: Callable[[int], bool]) -> None:
        self.meets, self.comm = meets, comm
        # Elastic: the meetings' votes carry it, as a group of its own would not outlive a
        # lost worker.
        self._group = dist.new_group(backend="gloo") \
            if comm.active and comm.membership is None else None
        self._vote: tuple[Any, torch.Tensor] | None = None

    def agreed(self, step: int, asked: str | None = None) -> str | None:
        """Why every rank stops after ``step`` (:data:`SIGTERM`, or a rank's ``asked``: its own
        reason, :data:`COLLAPSED`), or ``None`` to go on. Call after each step, on every rank."""
        wanted = SIGTERM if stop_requested() else asked
        if self.comm.membership is not None and self.comm.active:  # carried by the meeting's
            return SIGTERM if self.meets(step) and self.comm.membership.stop_voted else None  # vote
        if self.comm.membership is not None:  # the last worker of an elastic job: no meeting
            return wanted
        if self._group is None:
            return wanted
        if not self.meets(step):
            return None
        agreed = None
        if self._vote is not None:
            work, flag = self._vote
            work.wait()
            agreed = REASONS[int(flag.item())]
        flag = torch.tensor([float(REASONS.index(wanted))])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._vote = (work, flag)
        return agreed

    def settle(self) -> None:
        """Finish the vote in flight (every rank started the same ones) before leaving."""
        if self._vote is not None:
            self._vote[0].wait()
            self._vote = None
