"""Asynchronous Elastic Averaging momentum SGD (Async EAMSGD / "Async MEASGD"), as published.

Zhang, Choromanska & LeCun (2015), Algorithm 2 (asynchronous EAMSGD); You, Buluc & Demmel
(2017), Async MEASGD. Async EASGD (:mod:`shoal.strategies.async_easgd`) whose local steps use
Nesterov momentum ``delta``; each worker ``i`` runs, without waiting for any other::

    x = x^i
    if tau divides t^i:
        a)  x^i <- x^i - alpha (x - x~)        # x~ as the worker read it from the master
        b)  x~  <- x~  + alpha (x - x~)        # the master's update, under its lock
    v^i <- delta v^i - eta g^i(x + delta v^i)  # the gradient at the look-ahead point
    x^i <- x^i + v^i
    t^i <- t^i + 1

The elastic exchange sends ``x^i`` and pulls ``x^i``, not the look-ahead point the model's
parameters hold (``x^i + delta v^i``, where the next gradient is taken). The local step is
EAMSGD's, :class:`~shoal.strategies.easgd.NesterovLocalSteps` (``eta``, ``delta`` and weight
decay from the optimizer's groups at each step, so schedules apply); the master is Async
EASGD's, first come, first served.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.strategies.async_easgd import AsyncElasticBase, ElasticRule
from shoal.strategies.asynchronous import AsyncElasticOptions
from shoal.strategies.easgd import NesterovLocalSteps, check_nesterov_sgd
from shoal.strategies.registry import register


@register
class AsyncElasticAveragingMomentum(AsyncElasticBase):
    """Async EAMSGD: async-easgd whose local steps use Nesterov momentum (--momentum)."""

    name = "async-measgd"
    Options = AsyncElasticOptions
    Rule = ElasticRule

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: AsyncElasticOptions | None = None) -> None:
        check_nesterov_sgd(self.name, optimizer)
        super().__init__(model, optimizer, comm, options)
        self.nesterov = NesterovLocalSteps(self.flat, optimizer)
        self.x, self.v = self.nesterov.x, self.nesterov.v  # x^i and v^i (the same tensors)

    def worker_vector(self) -> torch.Tensor:
        return self.x

    @torch.no_grad()
    def local_step_with(self, pull: torch.Tensor | None) -> None:
        """Algorithm 2's local step, with line a)'s pull of ``x^i`` if one is due."""
        self.nesterov.step(pull)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "x": self.x.clone(), "v": self.v.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.x.copy_(state["x"])
        self.v.copy_(state["v"])

    @torch.no_grad()
    def restored(self, own: bool) -> None:
        """A worker the checkpoint has no state of starts at the center: ``x^i = x~``,
        ``v^i = 0``."""
        if not own:
            self.x.copy_(self.flat.pack())
            self.v.zero_()
