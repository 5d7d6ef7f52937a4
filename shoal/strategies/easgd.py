"""Synchronous Elastic Averaging SGD (Zhang, Choromanska & LeCun 2015; You et al. 2017).

Every worker explores on its own and is pulled, every ``tau`` steps, towards a center
variable x~ that is in turn pulled towards all workers. Each worker keeps its own copy of
the center, and one packed all-reduce keeps the copies equal::

    d  = alpha * (x - x~)      # this worker's elastic difference
    x -= d                     # the worker moves towards the center
    x~ += allreduce_sum(d)     # the center moves towards every worker

The worker's own move needs nothing from the others, and the center is next read ``tau``
steps later: so the all-reduce is started asynchronously and finished only when the center
is needed (the next exchange, evaluation or a checkpoint). Its communication hides behind
``tau`` steps of compute (``--no-overlap`` waits for it at once, to measure the difference).

The center copies are broadcast from rank 0 at each epoch's end, so rounding cannot make
them drift apart; the model evaluated and saved is the center. ``eamsgd`` is the same with
Nesterov momentum on the local steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shoal.comm import FlatParams, Handle
from shoal.comm.averaging import ModelCopy, average_buffers
from shoal.errors import ShoalError
from shoal.strategies.base import PeriodicOptions, PeriodicStrategy
from shoal.strategies.registry import register


@dataclass
class ElasticOptions(PeriodicOptions):
    alpha: float | None = field(default=None, metadata={
        "help": "elastic moving rate (default 0.9 / workers)"})
    overlap: bool = field(default=True, metadata={
        "help": "hide the center's all-reduce behind the next local steps"})

    def validate(self) -> None:
        super().validate()
        if self.alpha is not None and not 0 <= self.alpha <= 1:
            raise ShoalError(f"--alpha must be in [0, 1], got {self.alpha}")


@register
class ElasticAveraging(PeriodicStrategy):
    """Sync EASGD: every --tau steps, an elastic pull between each worker and the center."""

    name = "easgd"
    Options = ElasticOptions

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: ElasticOptions | None = None) -> None:
        super().__init__(model, optimizer, comm, options)
        self.alpha = self.options.alpha if self.options.alpha is not None else 0.9 / comm.world_size
        self.flat = FlatParams(model.parameters())
        self.center = ModelCopy(model)
        comm.broadcast(self.center.vector, src=0, name="center")  # one center to start from
        self._delta = torch.zeros_like(self.center.vector)
        self._pending: Handle | None = None

    @property
    def eval_module(self) -> nn.Module:
        self._finish()
        return self.center.with_buffers_of(self.model)

    @torch.no_grad()
    def exchange(self) -> None:
        self._finish()
        x = self.flat.pack()
        torch.sub(x, self.center.vector, out=self._delta).mul_(self.alpha)
        x.sub_(self._delta)
        self.flat.unpack()
        self._pending = self.comm.all_reduce_async(self._delta, "sum", "elastic")
        if not self.options.overlap:
            self._finish()

    @torch.no_grad()
    def _finish(self) -> None:
        """Complete the exchange in flight: add every worker's pull to the center."""
        if self._pending is not None:
            self.center.vector.add_(self._pending.wait())
            self._pending = None

    def end_epoch(self, epoch: int) -> None:
        self._finish()
        self.comm.broadcast(self.center.vector, src=0, name="center")
        average_buffers(self.model, self.comm)

    def state_dict(self) -> dict:
        self._finish()
        return {**super().state_dict(), "center": self.center.vector.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.center.vector.copy_(state["center"])


@register
class ElasticAveragingMomentum(ElasticAveraging):
    """Sync EAMSGD: EASGD whose local steps use Nesterov momentum (--momentum)."""

    name = "eamsgd"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: ElasticOptions | None = None) -> None:
        if not isinstance(optimizer, torch.optim.SGD):
            raise ShoalError(f"eamsgd takes local steps with SGD, not {type(optimizer).__name__}")
        for group in optimizer.param_groups:
            if group["momentum"] <= 0 or group["dampening"] != 0:
                raise ShoalError("eamsgd needs --momentum > 0 (and no dampening)")
            group["nesterov"] = True
        super().__init__(model, optimizer, comm, options)
