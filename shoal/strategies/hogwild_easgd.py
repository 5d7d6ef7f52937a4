"""Hogwild EASGD: asynchronous EASGD whose master updates the center without a lock.

You, Buluc & Demmel (2017), Hogwild EASGD: Async EASGD (:mod:`shoal.strategies.async_easgd`,
Algorithm 1 of Zhang, Choromanska & LeCun 2015) whose master applies the workers' center
updates concurrently, as Hogwild! (Niu et al. 2011) applies gradients. Each worker ``i``,
``t^i`` counting its local steps::

    x = x^i
    if tau divides t^i:
        a)  x^i <- x^i - alpha (x - x~)        # x~ as this exchange read it
        b)  x~  <- x~  + alpha (x - x~)        # no lock: concurrent exchanges interleave
    x^i <- x^i - eta g^i(x)

The server reads ``x~`` into the reply and adds ``alpha (x - x~)`` in place, each exchange on
its own thread: two exchanges may read the same ``x~``, and an element written by one may be
overwritten by another's read-modify-write (Hogwild's lost updates, element by element),
in exchange for never making one worker's exchange wait for another's.
"""

from __future__ import annotations

import torch

from shoal.core.header import Header
from shoal.strategies.async_easgd import AsyncElasticBase, ElasticRule
from shoal.strategies.asynchronous import AsyncElasticOptions
from shoal.strategies.registry import register


class UnlockedElasticRule(ElasticRule):
    """The elastic center update applied concurrently, without the shard's lock."""

    locked = False

    @torch.no_grad()
    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        reply.copy_(self.center)
        self.center.add_(payload - reply, alpha=header.fields["alpha"])  # a buffer of this call's own


@register
class HogwildElasticAveraging(AsyncElasticBase):
    """Hogwild EASGD: async-easgd whose server updates the center without a lock."""

    name = "hogwild-easgd"
    Options = AsyncElasticOptions
    Rule = UnlockedElasticRule
