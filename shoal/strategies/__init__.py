"""Coupling algorithms, one file each, registered by name.

``shoal.strategy(name, model, optimizer, **options)`` (in :mod:`shoal.runtime`) makes any of
them usable in a hand-written training loop; ``shoal train --strategy name`` uses the same
classes.
"""

from __future__ import annotations

from shoal.strategies import diloco, easgd, local_sgd, sync  # noqa: F401 - importing registers

# isort: split
# The asynchronous strategies register after the synchronous ones (the flags' order in --help).
from shoal.strategies import (  # noqa: F401 - importing registers
    async_easgd,
    async_measgd,
    async_msgd,
    async_sgd,
    groups,
    hogwild,
    hogwild_easgd,
)
from shoal.strategies.base import Strategy, make_options, option_fields, settings_of
from shoal.strategies.communication import Exchange, Pattern
from shoal.strategies.periodic import PeriodicOptions, PeriodicStrategy
from shoal.strategies.registry import STRATEGIES, get_strategy, register

__all__ = ["STRATEGIES", "Exchange", "Pattern", "PeriodicOptions", "PeriodicStrategy", "Strategy",
           "get_strategy", "make_options", "option_fields", "register", "settings_of"]
