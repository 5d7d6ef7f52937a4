"""Where a resumed run of workers that meet (``sync``, the periodic strategies) goes on.

A checkpoint holds the epoch's plan as the run had it: after a membership change
(``--elastic``) the rest of the epoch was dealt anew, an order of its own, which the
resumed run must go on with, or it would train again what the plan before the change had
already read and never what the lost workers left. On another number of workers (``sync``
anywhere; the periodic strategies from an epoch's end, :func:`~shoal.train.checkpoint.
check_workers`) the rest of the checkpoint's epoch is dealt over the workers there are now,
each with its own batch (so the global batch follows the world, as after a change under
``--elastic``), and the schedule follows the share of the epochs trained; the change is
recorded like one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shoal.data import EpochPlan
from shoal.train.membership.changes import MembershipChange, of_records


@dataclass
class SavedPlan:
    """A checkpoint's epoch plan (``order``: ``None`` for the epoch's own permutation) and
    the membership changes recorded so far."""

    order: torch.Tensor | None
    global_batch: int
    world: int
    changes: list[MembershipChange]

    @classmethod
    def of(cls, payload: dict[str, Any]) -> SavedPlan:
        """From a checkpoint (one written before plans were kept: the epoch's permutation
        over the checkpoint's ranks)."""
        return cls(payload.get("plan_order"), int(payload["global_batch"]),
                   int(payload.get("world_size", len(payload["ranks"]))),
                   of_records(payload.get("membership_changes")))


def go_on(saved: SavedPlan, n: int, global_batch: int, world: int, seed: int, epoch: int,
          epoch_step: int) -> tuple[EpochPlan, int] | None:
    """The plan the resumed epoch goes on with, and its step, on ``world`` workers with a
    ``global_batch``; ``None`` where the run's own plan of the epoch goes on (the epoch's
    start, or the same plan as the checkpoint's)."""
    if epoch_step == 0 and saved.order is None:
        return None
    plan = EpochPlan(n if saved.order is None else len(saved.order), saved.global_batch,
                     saved.world, seed, saved.order)
    if saved.world == world and saved.global_batch == global_batch:
        return None if saved.order is None else (plan, epoch_step)
    rest = plan.rest(plan.permutation(epoch), epoch_step)
    return EpochPlan(len(rest), global_batch, world, seed, rest), 0


__all__ = ["SavedPlan", "go_on"]
