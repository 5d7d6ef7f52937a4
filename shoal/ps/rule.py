"""What a parameter server asks of a strategy's update rule (:class:`ServerRule`)."""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from shoal.core.header import Header


@runtime_checkable
class ServerRule(Protocol):
    """How a server updates its shard on an EXCHANGE (one per strategy: its ``Rule``).

    ``fields``: the names of the header values the rule reads (``header.fields[name]``);
    they travel with every message, filled by the worker (see
    :meth:`shoal.strategies.asynchronous.AsyncStrategy.header`). ``locked``: ``True``
    applies one exchange at a time under the shard's lock; ``False`` lets exchanges of
    different clients run concurrently (in place, lock free).

    Two hooks are optional, called under the shard's lock where a rule has them
    (:class:`HearsSent`, :class:`HearsForget`; see :func:`tell`): ``sent(client)`` after a
    pusher's PULL was answered with the center (a rule that remembers what each pusher
    holds: DC-ASGD's ``w_bak``; the coordinator's and other readers' pulls are not told),
    ``forget(client)`` when a client left or was lost.
    """

    fields: ClassVar[tuple[str, ...]]
    locked: bool

    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        """``payload``: this shard's slice of what the worker sent (gradient or x_i);
        fill ``reply`` with this shard's slice to send back (new parameters, or x~ before
        the update). The center is the rule's own (it was built on it)."""

    def state_dict(self) -> dict:
        """The rule's state (momentum buffers, step counts) for a checkpoint."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""


@runtime_checkable
class NamedFields(Protocol):
    """A rule (or its class) that names the header values it reads: :attr:`ServerRule.fields`
    (a rule without it reads none)."""

    fields: tuple[str, ...]


@runtime_checkable
class Locking(Protocol):
    """A rule that says whether it applies one exchange at a time: :attr:`ServerRule.locked`
    (a rule without it is locked)."""

    locked: bool


@runtime_checkable
class HearsSent(Protocol):
    """A rule told when a pusher's PULL was answered with the center (DC-ASGD's ``w_bak``)."""

    def sent(self, client: int) -> None:
        """``client`` now holds the center as it is."""


@runtime_checkable
class HearsForget(Protocol):
    """A rule told when a client left or was lost."""

    def forget(self, client: int) -> None:
        """Drop what the rule keeps of ``client``."""


def tell(rule: object, hook: str, client: int) -> None:
    """Call ``rule``'s optional ``hook(client)`` (``"sent"``: :class:`HearsSent`,
    ``"forget"``: :class:`HearsForget`) if it has one.

    Raises:
        ValueError: ``hook`` is neither.
    """
    if hook == "sent":
        if isinstance(rule, HearsSent):
            rule.sent(client)
    elif hook == "forget":
        if isinstance(rule, HearsForget):
            rule.forget(client)
    else:
        raise ValueError(f"no rule hook {hook!r} (sent, forget)")
