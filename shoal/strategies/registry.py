"""Strategies by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.errors import ShoalError
from shoal.loading import load_object

if TYPE_CHECKING:
    from shoal.strategies.base import Strategy

STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available as ``--strategy cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} needs a non-empty `name`")
    existing = STRATEGIES.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"strategy name {cls.name!r} is taken by {existing.__qualname__}")
    STRATEGIES[cls.name] = cls
    return cls


def get_strategy(spec: str) -> type[Strategy]:
    """The strategy class named ``spec`` (a registered name or ``pkg.module:Class``)."""
    from shoal.strategies.base import Strategy

    if spec in STRATEGIES:
        return STRATEGIES[spec]
    if ":" in spec:
        cls = load_object(spec, "strategy")
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise ShoalError(f"strategy {spec!r} is not a subclass of shoal.Strategy")
        return cls
    raise ShoalError(f"unknown strategy {spec!r}; choose from {', '.join(sorted(STRATEGIES))} "
                     "or give pkg.module:Class")
