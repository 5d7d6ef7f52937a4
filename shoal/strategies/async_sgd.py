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

import dataclasses
from typing import Any

import torch
from torch import nn

from shoal.core.header import Header
from shoal.errors import ShoalError
from shoal.schema import flag_name
from shoal.strategies.asynchronous import AsyncOptions, AsyncStrategy, check_server_sgd, one_setting
from shoal.strategies.communication import Pattern
from shoal.strategies.delay import DelayCompensation
from shoal.strategies.registry import register


@dataclasses.dataclass
class GradientOptions(AsyncOptions):
    """Options of the strategies whose workers push gradients (async-sgd, async-msgd,
    groups): the servers', and delay compensation."""

    delay_compensation: float = dataclasses.field(default=0.0, metadata={
        "help": "DC-ASGD-a's lambda_0 (Zheng et al. 2017): the server corrects each pushed "
                "gradient for the updates applied since its worker last received the "
                "parameters (0: off)"})

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.delay_compensation < float("inf"):
            raise ShoalError(f"{flag_name('delay_compensation')} must be a finite number at "
                             f"least 0, got {self.delay_compensation}")


class SGDRule:
    """The server's step for each push: ``x <- x - eta (g + lambda x)``."""

    locked = True
    #: The worker's learning rate and weight decay at the step it pushed (its optimizer's).
    fields = ("lr", "weight_decay")

    def __init__(self, center: torch.Tensor, options: Any = None) -> None:
        self.center = center  # x: this server's shard, updated in place
        self._d = torch.empty_like(center)
        lambda0 = options.delay_compensation if isinstance(options, GradientOptions) else 0.0
        #: DC-ASGD's state where --delay-compensation is on (None: pushed gradients as sent)
        self.delay = DelayCompensation(center, lambda0) if lambda0 else None

    @torch.no_grad()
    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        d = self.direction(header, payload)
        self.center.add_(d, alpha=-header.fields["lr"])
        self.replied(header, reply)

    def replied(self, header: Header, reply: torch.Tensor) -> None:
        """Send the center after this push back to its client (its next gradient's point)."""
        reply.copy_(self.center)
        self.sent(header.client)

    def direction(self, header: Header, g: torch.Tensor) -> torch.Tensor:
        """``g + lambda x`` (the gradient with weight decay; delay-compensated first where
        --delay-compensation is on), in a buffer of the rule's."""
        if self.delay is not None:
            g = self.delay.compensate(header.client, g, self._d)
        decay = header.fields["weight_decay"]
        if decay:
            return torch.add(g, self.center, alpha=decay, out=self._d)
        return g if g is self._d else self._d.copy_(g)

    def sent(self, client: int) -> None:
        """The server sent the center to ``client`` (a pull, or this rule's reply)."""
        if self.delay is not None:
            self.delay.sent(client)

    def forget(self, client: int) -> None:
        """``client`` is gone: what the rule kept for it is freed."""
        if self.delay is not None:
            self.delay.forget(client)

    def state_dict(self) -> dict:
        return self.delay.state_dict() if self.delay is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.delay is not None:
            self.delay.load_state_dict(state)


@register
class AsyncSGD(AsyncStrategy):
    """Async SGD (Downpour): push each gradient, the server steps, pull the parameters."""

    name = "async-sgd"
    Options = GradientOptions
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
