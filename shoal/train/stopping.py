"""Stopping every rank after the same step when SIGTERM reaches one of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.comm import Comm
from shoal.core.stop import stop_requested


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

    def agreed(self, step: int) -> bool:
        """Whether every rank stops after ``step`` (call after each step, on every rank)."""
        if self.comm.membership is not None:  # carried by the meeting's own vote
            return self.meets(step) and self.comm.membership.stop_voted
        if self._group is None:
            return stop_requested()
        if not self.meets(step):
            return False
        agreed = False
        if self._vote is not None:
            work, flag = self._vote
            work.wait()
            agreed = flag.item() > 0
        flag = torch.tensor([1.0 if stop_requested() else 0.0])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._vote = (work, flag)
        return agreed

    def settle(self) -> None:
        """Finish the vote in flight (every rank started the same ones) before leaving."""
        if self._vote is not None:
            self._vote[0].wait()
            self._vote = None
