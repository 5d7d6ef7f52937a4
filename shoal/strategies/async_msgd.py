"""Asynchronous momentum SGD on a parameter server ("Async MSGD" of SC17).

You, Buluc & Demmel (2017), Async MSGD: Async SGD (:mod:`shoal.strategies.async_sgd`) whose
server keeps a momentum buffer, the non-elastic baseline of Async EAMSGD. Each worker ``i``
repeats, without waiting for any other::

    g^i <- gradient of its next mini-batch at x^i     # x^i: the parameters it last pulled
    push g^i;  the server, on arrival:
        d <- g^i + lambda x
        v <- mu v + d                                  # one buffer v, shared by all pushes
        x <- x - eta v
    pull:      x^i <- x

This is PyTorch's (and Sutskever et al.'s heavy-ball, written with ``eta`` outside the
buffer) form of momentum, ``torch.optim.SGD(momentum=mu)`` without dampening or Nesterov:
at a constant ``eta`` it equals the classic ``v' <- mu v' - eta d; x <- x + v'`` with
``v' = -eta v``; under a changing ``eta`` the past steps are rescaled by the new rate, as in
PyTorch. ``eta``, ``mu`` and ``lambda`` come with each push from the worker's optimizer group
at that step, in the order the pushes arrive (under the server's lock).
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.core.header import Header
from shoal.strategies.async_sgd import AsyncSGD, SGDRule
from shoal.strategies.registry import register


class MomentumRule(SGDRule):
    """The server's step for each push: ``v <- mu v + (g + lambda x); x <- x - eta v``."""

    locked = True
    fields = ("lr", "momentum", "weight_decay")

    def __init__(self, center: torch.Tensor, options: Any = None) -> None:
        super().__init__(center, options)
        self.velocity = torch.zeros_like(center)  # v

    @torch.no_grad()
    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        d = self.direction(header, payload)
        self.velocity.mul_(header.fields["momentum"]).add_(d)
        self.center.add_(self.velocity, alpha=-header.fields["lr"])
        self.replied(header, reply)

    def state_dict(self) -> dict:
        return {"velocity": self.velocity.clone(), **super().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.velocity.copy_(state["velocity"])
        super().load_state_dict(state)


@register
class AsyncMomentumSGD(AsyncSGD):
    """Async MSGD: as async-sgd, the server's steps with momentum (--momentum)."""

    name = "async-msgd"
    Rule = MomentumRule
    applies_momentum = True
