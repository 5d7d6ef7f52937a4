"""What a strategy's options (and its server rule) may declare they can do, each a
:class:`~typing.Protocol` checked with ``isinstance``: a strategy's code asks these, never
``hasattr``. Options are a dataclass of their own (:class:`~shoal.strategies.base.Strategy`'s
``Options``); each capability here is a method or field it may have:

- :class:`ValidatedOptions`: ``validate()``, their own checks once made;
- :class:`WorkerCheckedOptions`: ``check_workers(n)``, once the number of workers is known;
- :class:`SettingsOptions`: ``settings(n)``, how a run of ``n`` workers takes them;
- :class:`ServedOptions`: ``servers``, the parameter servers of an asynchronous strategy;
- :class:`AdmittingOptions`: ``admission(n)``, when those servers apply exchanges;
- :class:`~shoal.ps.rule.NamedFields`: a server rule's ``fields``, the header values it
  reads (the parameter server's own protocol, here too).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from shoal.ps.admission import Admission
from shoal.ps.rule import NamedFields


@runtime_checkable
class ValidatedOptions(Protocol):
    """Options with a check of their own, run once they are made (e.g. a period at least 1)."""

    def validate(self) -> None:
        """Raise :class:`~shoal.errors.ShoalError` where a value is out of its range."""


@runtime_checkable
class WorkerCheckedOptions(Protocol):
    """Options whose range depends on the number of workers (e.g. a rate that must shrink
    as workers are added)."""

    def check_workers(self, workers: int) -> None:
        """Raise :class:`~shoal.errors.ShoalError` where they do not fit ``workers`` workers."""


@runtime_checkable
class SettingsOptions(Protocol):
    """Options that say how a run of some number of workers takes them (an elastic
    strategy's period and moving rate), for its first line and ``config.json``."""

    def settings(self, workers: int) -> dict[str, Any]:
        """The settings a run of ``workers`` workers takes."""


@runtime_checkable
class ServedOptions(Protocol):
    """Options that say how many parameter servers hold the vector (``--servers``)."""

    servers: int


@runtime_checkable
class AdmittingOptions(Protocol):
    """Options that say when the servers apply the workers' exchanges (:class:`AsyncOptions`:
    the order, the staleness bound, the pushers)."""

    def admission(self, workers: int) -> Admission:
        """The admission of ``workers`` workers' exchanges."""


__all__ = ["AdmittingOptions", "NamedFields", "ServedOptions", "SettingsOptions",
           "ValidatedOptions", "WorkerCheckedOptions"]
