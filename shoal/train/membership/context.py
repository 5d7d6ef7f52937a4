"""What membership's components may read and drive of those that call them: a small typed
context each, declared as a :class:`~typing.Protocol`, so that no component holds an untyped
back-reference and none imports the trainer (it sits above membership).

- :class:`LoopContext`: what a tracker (:mod:`~shoal.train.membership.tracker`) reads of
  the training loop, and the two calls that change it (:meth:`LoopContext.install_plan`,
  :meth:`LoopContext.regroup`). Its plan is read-only: a new plan is installed, never set.
- :class:`LiveContext` (a part of it): what a joiner's hand-over
  (:mod:`~shoal.train.membership.handover`) takes from a live worker and puts in place in
  the joiner; :class:`JoinSide`: the tracker's own part of it.
- :class:`Checkpoints`, :class:`ChangeRecords`: the checkpoints' and the records'
  membership sides.

The :class:`~shoal.train.trainer.Trainer` is a :class:`LoopContext`. Server 0's side has its
own: :class:`~shoal.train.membership.server.context.ServerContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.data import Dataset, EpochPlan
from shoal.strategies.base import Strategy
from shoal.strategies.precision import MixedPrecision
from shoal.train.membership.changes import MembershipChange
from shoal.train.membership.resume import SavedPlan
from shoal.train.state import RunState

#: A loop's batches: (inputs, labels, rows of the global batch) each step.
Batches = Iterator[tuple[torch.Tensor, torch.Tensor, int]]


class Checkpoints(Protocol):
    """The checkpoints' membership side: what a resumed run goes on from, and this worker's
    part of the next checkpoint."""

    saved_plan: SavedPlan | None  #: ``--resume``: the checkpoint's epoch plan
    own_part: dict[str, Any] | None  #: ``--resume``: this worker's own part
    #: this worker's membership part of a checkpoint, asked at each save
    elastic_part: Callable[[], dict[str, Any]] | None
    elastic_payload: dict[str, Any] | None  #: ``--resume``: a detached worker's payload


class ChangeRecords(Protocol):
    """The records' membership side: the changes ``summary.json`` keeps, and who writes."""

    changes: list[MembershipChange] | None

    def take_over(self, st: RunState) -> None:
        """The lowest worker id left writes the records from now on (worker 0 lost)."""


class LiveContext(Protocol):
    """What a joiner's hand-over takes from a live worker, and puts in place in a joiner."""

    @property
    def comm(self) -> Comm: ...

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def strategy(self) -> Strategy: ...

    @property
    def scheduler(self) -> LRScheduler: ...

    @property
    def amp(self) -> MixedPrecision: ...

    @property
    def state(self) -> RunState: ...

    @property
    def plan(self) -> EpochPlan:
        """The plan being trained (read-only: a new one is installed, never set)."""


class LoopContext(LiveContext, Protocol):
    """What a tracker reads of the training loop and the two calls that change it; a live
    worker's state too, which a process-group job's joins hand over."""

    @property
    def cfg(self) -> TrainConfig: ...

    @property
    def data(self) -> Dataset: ...

    @property
    def batches(self) -> Batches: ...

    @property
    def checkpointer(self) -> Checkpoints: ...

    @property
    def recorder(self) -> ChangeRecords: ...

    def install_plan(self, plan: EpochPlan, shard: int) -> None:
        """Train from ``plan`` from now on, as its shard ``shard``."""

    def regroup(self) -> None:
        """The group was re-formed: this worker's place in it, and the strategy's."""


class JoinSide(Protocol):
    """A process-group tracker's side of a join's hand-over (its
    :class:`~shoal.train.membership.tracker.joins.Joins`): what it hands a joiner, and a
    joiner's taking it."""

    def handover_state(self) -> dict[str, Any]:
        """What a joiner takes of this worker's side."""

    def joined(self, mine: str, theirs: dict[str, str], stall_s: float | None = None) -> None:
        """After a hand-over: the join's record with both sides' digests."""

    def take_over(self, order: torch.Tensor, state: dict[str, Any]) -> None:
        """A joiner: the rest of the epoch (``order``) and :meth:`handover_state`'s ``state``."""


__all__ = ["Batches", "ChangeRecords", "Checkpoints", "JoinSide", "LiveContext", "LoopContext"]
