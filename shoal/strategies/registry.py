"""Strategies by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.errors import ShoalError
from shoal.loading import load_object

if TYPE_CHECKING:
    from shoal.strategies.base import Strategy

STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available by its name.

    Then ``--strategy cls.name``, `shoal.strategy` and ``shoal bench --strategies`` find
    it, and its options become flags.

    Args:
        cls: A subclass of `shoal.Strategy` with a non-empty ``name``.

    Returns:
        ``cls`` itself.

    Raises:
        ValueError: ``cls.name`` is empty, or taken by another class.
    """
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} needs a non-empty `name`")
    existing = STRATEGIES.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"strategy name {cls.name!r} is taken by {existing.__qualname__}")
    STRATEGIES[cls.name] = cls
    return cls


def get_strategy(spec: str) -> type[Strategy]:
    """The strategy class named ``spec``.

    Args:
        spec: A registered name (``shoal.STRATEGIES``) or ``pkg.module:Class``, imported
            then.

    Returns:
        The class, a subclass of `shoal.Strategy`.

    Raises:
        ShoalError: An unknown name, a ``pkg.module:Class`` that cannot be imported, or a
            class that is not a `shoal.Strategy`.
    """
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
