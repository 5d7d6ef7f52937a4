"""Asynchronous Elastic Averaging SGD (Async EASGD), as published.

Zhang, Choromanska & LeCun (2015), "Deep learning with Elastic Averaging SGD", Algorithm 1
(asynchronous EASGD); You, Buluc & Demmel (2017), Async EASGD. The master holds the center
``x~``; each worker ``i`` runs, ``t^i`` counting its own local steps, without waiting for any
other worker::

    x = x^i
    if tau divides t^i:
        a)  x^i <- x^i - alpha (x - x~)        # x~ as the worker read it from the master
        b)  x~  <- x~  + alpha (x - x~)        # the master's update, with the same x~
    x^i <- x^i - eta g^i(x)                    # the gradient is taken at x, before the pull
    t^i <- t^i + 1

In shoal, step ``t`` of a worker (its gradient already taken at ``x``) sends ``x`` when
``tau`` divides ``t`` (so at its first step too) and receives ``x~``; the server, under its
lock, replies with its center and then does b); the worker takes its local step (your
optimizer's: plain SGD is the paper's) and subtracts the pull of a). The server takes the
exchanges first come, first served; ``--order round-robin`` makes it take worker ``w``'s
``n``-th exchange only after worker ``w - 1``'s ``n``-th, the original EASGD master SC17
measured against (a lost worker is skipped). ``alpha`` defaults to the paper's
``beta = 0.9`` over ``p`` workers, ``alpha = 0.9 / p``; each center update moves ``x~`` a
fraction ``alpha`` towards one worker, a convex combination for any alpha in [0, 1].
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.core.header import Header
from shoal.ps.admission import ORDERS
from shoal.strategies.asynchronous import AsyncElasticOptions, AsyncStrategy
from shoal.strategies.communication import Pattern
from shoal.strategies.registry import register


class ElasticRule:
    """The master's side of an elastic exchange: reply ``x~``, then ``x~ <- x~ + alpha (x - x~)``
    with the worker's ``x`` (the payload) and ``alpha`` (its header's)."""

    locked = True
    fields = ("alpha",)  #: the worker's moving rate

    def __init__(self, center: torch.Tensor, options: Any = None) -> None:
        self.center = center  # x~: this server's shard, updated in place
        self._d = torch.empty_like(center)

    @torch.no_grad()
    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        reply.copy_(self.center)
        d = torch.sub(payload, reply, out=self._d)
        self.center.add_(d, alpha=header.fields["alpha"])

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclasses.dataclass
class AsyncEasgdOptions(AsyncElasticOptions):
    """async-easgd's options: its server may also take exchanges in round-robin order."""

    orders: ClassVar[tuple[str, ...]] = ORDERS


class AsyncElasticBase(AsyncStrategy):
    """The worker of the asynchronous elastic strategies: an elastic exchange with the
    master every ``tau`` local steps (at the step's start), then the local step."""

    Options: ClassVar[type] = AsyncElasticOptions
    carries_step: ClassVar[bool] = False  # x is sent before the step's local update

    @classmethod
    def communication(cls, options: AsyncElasticOptions, workers: int) -> Pattern:
        """Every worker sends its parameters and pulls the center, every ``tau`` steps."""
        return cls.through_servers(options, workers, "parameters, then the center", options.tau)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: AsyncElasticOptions | None = None) -> None:
        super().__init__(model, optimizer, comm, options)
        self.alpha = self.options.moving_rate(comm.world_size)
        self._center = torch.empty_like(self.flat.buffer)  # x~ as read from the master
        self._pull = torch.empty_like(self.flat.buffer)  # alpha (x - x~)

    def worker_vector(self) -> torch.Tensor:
        """``x^i`` as one flat vector (laid out as :attr:`flat`)."""
        return self.flat.pack()

    @torch.no_grad()
    def update(self, t: int) -> None:
        pull = None
        if t % self.options.tau == 0:
            x = self.worker_vector()
            self.exchange(x, self._center)
            pull = torch.sub(x, self._center, out=self._pull).mul_(self.alpha)
        self.local_step_with(pull)

    @torch.no_grad()
    def flush(self) -> None:
        """One more elastic exchange, if local steps were taken since the last: the center
        moves towards this worker's last ``x`` (the worker, at its end, keeps its own)."""
        if self.counted < self.samples:
            self.carried = self.samples
            self.exchange(self.worker_vector(), self._center)

    @torch.no_grad()
    def local_step_with(self, pull: torch.Tensor | None) -> None:
        """``x^i <- x^i - eta g(x)`` (your optimizer's step), then line a)'s pull, if any."""
        self.local_step()
        if pull is not None:
            for x, d in zip(self.flat.tensors, self.flat.views(pull), strict=True):
                x.sub_(d)


@register
class AsyncElasticAveraging(AsyncElasticBase):
    """Async EASGD: every --tau steps an elastic exchange with the center on the server."""

    name = "async-easgd"
    Options = AsyncEasgdOptions
    Rule = ElasticRule
