"""Stopping every rank after the same step when SIGTERM reaches one of them, or one of
them is told the run collapsed (an asynchronous run's coordinator says so)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.comm import Comm
from shoal.core.stop import stop_requested
from shoal.errors import ShoalError

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


#: The least time between two votes (seconds), unless ``SHOAL_STOP_VOTE_S`` says another
#: (0: a vote at every meeting). A vote after every step of a fast synchronous loop costs
#: as much as the step's own exchange on one host; spaced, it costs next to nothing, and a
#: SIGTERM is acted on within two spacings (plus two meetings).
VOTE_SPACING_S = 0.05


def vote_spacing() -> float:
    """The least seconds between two votes: ``SHOAL_STOP_VOTE_S`` or :data:`VOTE_SPACING_S`.

    Raises:
        ShoalError: ``SHOAL_STOP_VOTE_S`` is not a number of seconds from 0 to 60.
    """
    given = os.environ.get("SHOAL_STOP_VOTE_S")
    if given is None:
        return VOTE_SPACING_S
    try:
        seconds = float(given)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 60:
        raise ShoalError(f"SHOAL_STOP_VOTE_S={given!r}: expected seconds from 0 to 60")
    return seconds


class StopVote:
    """Whether all ranks stop after this step (``stop_requested`` on any of them).

    They vote in a tiny all-reduce on a Gloo group of its own, at the strategy's own meeting
    points (the steps ``meets(step)`` says the workers exchanged after: every ``tau``-th for
    the periodic strategies, so it adds no coupling), at most one per
    :func:`vote_spacing`, and act on a vote one vote later, so nobody waits for it.
    Each vote also carries, from every rank, the least step of the vote after next (its
    own steps' pace); the largest is agreed, so every rank votes at the same meetings.
    """

    def __init__(self, comm: Comm, meets: Callable[[int], bool]) -> None:
        self.meets, self.comm = meets, comm
        # Elastic: the meetings' votes carry it, as a group of its own would not outlive a
        # lost worker.
        self._group = dist.new_group(backend="gloo") \
            if comm.active and comm.membership is None else None
        self._vote: tuple[Any, torch.Tensor] | None = None
        self._from = 0  # the next vote is at the first meeting from this step on
        self._last: tuple[int, float] | None = None  # the last vote's step and time
        self._spaced = vote_spacing()

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
        if step < self._from or not self.meets(step):
            return None
        agreed, self._from = None, step + 1  # the first vote: the next meeting votes too
        if self._vote is not None:
            work, flag = self._vote
            work.wait()
            agreed = REASONS[int(flag[0].item())]
            self._from = max(int(flag[1].item()), step + 1)
        after_next = self._from + self._spacing(step)
        flag = torch.tensor([float(REASONS.index(wanted)), float(after_next)],
                            dtype=torch.float64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._vote, self._last = (work, flag), (step, time.perf_counter())
        return agreed

    def _spacing(self, step: int) -> int:
        """Steps between votes at this rank's pace since the last vote."""
        if self._last is None or step <= self._last[0]:
            return 1
        per_step = (time.perf_counter() - self._last[1]) / (step - self._last[0])
        return max(1, math.ceil(self._spaced / max(per_step, 1e-6)))

    def settle(self) -> None:
        """Finish the vote in flight (every rank started the same ones) before leaving."""
        if self._vote is not None:
            self._vote[0].wait()
            self._vote = None
