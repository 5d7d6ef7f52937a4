"""Asynchronous SGD on a parameter server (Downpour SGD; "Async SGD" of SC17).

Dean et al. (2012), "Large scale distributed deep networks", Downpour SGD with
``n_fetch = n_push = 1``; You, Buluc & Demmel (2017), "Scaling deep learning on GPU and
Knights Landing clusters", Async SGD (the baseline of Async EASGD). The server holds the
parameters ``x``; each worker ``i``, without waiting for any other, repeats::

    g^i <- gradient of its next mini-batch at x^i     # x^i: the parameters it last pulled
    push g^i;  the server, on arrival:  x <- x - eta (g^i + lambda x)
    pull:      x^i <- x                                # the server's x right after that update

The server applies the pushes one at a time, in the order they arrive (under its lock), so
``g^i`` may be ``s`` versions stale: ``s`` other pushes were applied between worker ``i``'s
pull and its push (the staleness histogram; ``--max-staleness`` bounds it). ``eta`` and
``lambda`` are the worker's learning rate and weight decay at that step (its optimizer
group's, so schedules apply), sent with the push: the server's step is exactly
``torch.optim.SGD``'s without momentum. The worker never steps its own optimizer on the
parameters; its momentum, if any, is not used (``async-msgd`` is the momentum form).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.core.pairs import Header
from shoal.strategies.asynchronous import AsyncOptions, AsyncStrategy, check_server_sgd, one_setting
from shoal.strategies.communication import Pattern
from shoal.strategies.registry import register


class SGDRule:
    """The server's step for each push: ``x <- x - eta (g + lambda x)``."""

    locked = True
    #: The worker's learning rate and weight decay at the step it pushed (its optimizer's).
    fields = ("lr", "weight_decay")

    def __init__(self, center: torch.Tensor, options: Any = None) -> None:
        self.center = center  # x: this server's shard, updated in place
        self._d = torch.empty_like(center)

    @torch.no_grad()
    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        d = self.direction(header, payload)
        self.center.add_(d, alpha=-header.fields["lr"])
        reply.copy_(self.center)

    def direction(self, header: Header, g: torch.Tensor) -> torch.Tensor:
        """``g + lambda x`` (the gradient with weight decay), in a buffer of the rule's."""
        decay = header.fields["weight_decay"]
        if decay:
            return torch.add(g, self.center, alpha=decay, out=self._d)
        return self._d.copy_(g)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@register
class AsyncSGD(AsyncStrategy):
    """Async SGD (Downpour): push each gradient, the server steps, pull the parameters."""

    name = "async-sgd"
    Options = AsyncOptions
    Rule = SGDRule
    applies_momentum = False  # the server's rule is plain SGD (async-msgd's has momentum)

    @classmethod
    def asynchronous_groups(cls, options: AsyncOptions, workers: int) -> int:
        """Every worker pushes its own gradient, on its own time: ``workers`` groups."""
        return workers

    @classmethod
    def communication(cls, options: AsyncOptions, workers: int) -> Pattern:
        """Every worker pushes its gradient and pulls the parameters, every step."""
        return cls.through_servers(options, workers, "gradients, then parameters")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: AsyncOptions | None = None) -> None:
        check_server_sgd(self.name, model, optimizer, self.applies_momentum)
        super().__init__(model, optimizer, comm, options)
        self._grad = torch.zeros_like(self.flat.buffer)
        self._grad_views = self.flat.views(self._grad)

    @torch.no_grad()
    def update(self, t: int) -> None:
        """Push this step's gradient (at the parameters last pulled) and pull the server's
        parameters after its step."""
        one_setting(self.name, self.optimizer)
        for view, p in zip(self._grad_views, self.flat.tensors, strict=True):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
        self.exchange(self._grad, self.flat.buffer)
        self.flat.unpack()
        # The server took this step for the optimizer: a learning-rate scheduler watching for
        # optimizer.step() must see that it happened, or it warns that the schedule is off.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
