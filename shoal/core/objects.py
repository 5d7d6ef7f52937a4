"""Bookkeeping collectives of a :class:`~shoal.core.comm.Comm` (metrics, checkpoints,
settings handed out): a few numbers, or picklable objects, not booked as training traffic;
under elastic membership voted on like every other meeting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.inflight import all_objects
from shoal.core.ops import reduce_op
from shoal.core.waits import describe


class ObjectCollectives:
    """The object and value collectives of :class:`~shoal.core.comm.Comm` (a mixin: it
    reads the Comm's rank, device, log, membership and meetings)."""

    rank: int
    world_size: int
    device: torch.device
    log: Any
    membership: Any
    active: bool
    _meet: Any

    def reduce_values(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """All-reduce a few Python numbers (metrics); returns the reduced list."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.active:
            with self.log.track(describe("all_reduce", "values")):
                self._meet(lambda: dist.all_reduce(t, op=reduce_op(op), async_op=True), keep=t)
            if op == "avg":
                t /= self.world_size
        return t.tolist()

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Pickle-gather ``obj`` from every rank to ``dst`` (others get ``None``)."""
        if not self.active:
            return [obj]

        def gather() -> list[Any] | None:
            if self.membership is not None:  # elastic: left at once when the vote fails
                out = all_objects(self.membership, obj)
            else:
                out = [None] * self.world_size if self.rank == dst else None
                dist.gather_object(obj, out, dst=dst)
            return out if self.rank == dst else None

        with self.log.track(describe("gather", "objects")):
            out = self._meet(gather)
        return out if self.active or self.rank != dst else [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every rank and return it."""
        if not self.active:
            return obj
        box = [obj]
        with self.log.track(describe("broadcast", "object")):
            if self.membership is None:
                dist.broadcast_object_list(box, src=src)
            elif got := self._meet(lambda: all_objects(self.membership, obj if self.rank == src
                                                       else None)):
                box[0] = got[src]  # elastic: left at once when the vote fails
        return box[0]
