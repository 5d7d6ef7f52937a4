"""When a shard applies an exchange: arrival order, round-robin order, bounded staleness.

:class:`Admission` is the policy, one object built from a strategy's options once the
number of workers is known (``AsyncOptions.admission``) and checked as it is built: the
preflight builds it to refuse bad settings in one line before any process starts, and each
server builds the same one to serve by. :class:`Ledger` is one shard's record of what the
policy reads: the version each client last saw, each pusher's exchanges so far, and the
staleness of every exchange applied.

The staleness of an exchange is the number of versions the shard applied between the
client's last reply from it and the exchange. ``max_staleness=k`` applies an exchange only
when, after it, the other live pushers can still all push with a staleness of at most
``k`` (in order of their last pull: the one that pulled longest ago first); otherwise the
pusher waits (for the others to push or be lost). Exchanges are then never applied with a
staleness above ``k``, and the pusher that pulled longest ago can always go, so progress
needs only ``k >= pushers - 1``; a smaller ``k`` is refused. ``order="round-robin"``
applies pusher ``w``'s n-th exchange after pusher ``w-1``'s n-th (lost and finished ones
skipped): the original EASGD master.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

from shoal.errors import ShoalError
from shoal.schema import flag_name

#: How many timeouts an exchange may be held back (below the client's wait for its reply, 2).
HOLD = 1.5
#: Orders in which a server applies exchanges.
ORDERS = ("arrival", "round-robin")


def check_settings(order: str, max_staleness: int | None) -> None:
    """The settings that need no count of workers: a known order, a bound of at least 0."""
    if order not in ORDERS:
        raise ShoalError(f"{flag_name('order')} must be one of {', '.join(ORDERS)}, "
                         f"got {order!r}")
    if max_staleness is not None and max_staleness < 0:
        raise ShoalError(f"{flag_name('max_staleness')} must be at least 0, got {max_staleness}")


@dataclass(frozen=True)
class Admission:
    """The order in which a shard applies the exchanges of its ``pushers`` (the clients
    that exchange: workers, or a compute group's leaders; ``unit`` is what one is called in
    messages), and the bound on their staleness (``None``: none)."""

    pushers: tuple[int, ...]
    order: str = "arrival"
    max_staleness: int | None = None
    unit: str = "worker"

    def __post_init__(self) -> None:
        object.__setattr__(self, "pushers", tuple(sorted(set(self.pushers))))
        check_settings(self.order, self.max_staleness)
        n, bound = len(self.pushers), self.max_staleness
        if bound is not None and bound < n - 1:
            raise ShoalError(f"{flag_name('max_staleness')} {bound} with {n} {self.unit}s: a "
                             f"{self.unit} waits for the {n - 1} others to push, so the bound "
                             f"must be at least {n - 1} ({self.unit}s - 1)")

    @property
    def waits(self) -> bool:
        """Whether an exchange may ever have to wait (round robin, or a bound)."""
        return self.order != "arrival" or self.max_staleness is not None

    def holding(self) -> str:
        """What holds an exchange back, for the message when it waited too long."""
        return "round-robin order" if self.order == "round-robin" else \
            f"staleness bound {self.max_staleness}"

    def blockers(self, c: int, ledger: Ledger, live: Iterable[int]) -> list[int]:
        """The pushers the exchange of client ``c`` must wait for now (empty: apply it),
        among the ``live`` ones."""
        if c not in self.pushers:
            return []
        others = [w for w in live if w != c]
        if self.order == "round-robin":
            n, counts = ledger.counts[c], ledger.counts
            before = [u for u in others if (u < c and counts[u] <= n) or (u > c and counts[u] < n)]
            if before:
                return before
        if self.max_staleness is not None:
            after = ledger.version + 1
            ranked = sorted(others, key=lambda u: ledger.pulled[u])
            for j, u in enumerate(ranked):
                if after + j - ledger.pulled[u] > self.max_staleness:
                    return ranked[:j + 1]
        return []


class Ledger:
    """One shard's versions: how many exchanges it applied (:attr:`version`), the version
    each client last saw, each client's exchanges, and the staleness of each applied one.
    Its owner serializes every call (the shard's lock)."""

    def __init__(self, clients: int) -> None:
        self.version = 0
        #: staleness -> exchanges applied with it
        self.staleness: collections.Counter[int] = collections.Counter()
        self.pulled = dict.fromkeys(range(clients), 0)  #: version of each client's last reply
        self.counts: collections.Counter[int] = collections.Counter()  #: exchanges per client

    def book(self, c: int) -> int:
        """Client ``c``'s exchange is applied now; returns the new version."""
        self.staleness[self.version - self.pulled[c]] += 1
        self.version += 1
        self.counts[c] += 1
        self.pulled[c] = self.version
        return self.version

    def rejoin(self, c: int, others: list[int]) -> None:
        """Client ``c`` pushes again after resting: in a round-robin it takes its turn from
        the slowest of ``others`` (the pushers active meanwhile) instead of owing every
        turn it missed."""
        if others:
            self.counts[c] = max(self.counts[c], min(self.counts[u] for u in others))

    def saw(self, c: int) -> int:
        """Client ``c`` is sent the shard as it is now (a pull); returns the version."""
        self.pulled[c] = self.version
        return self.version

    def restore(self, version: int, staleness: dict) -> None:
        """Go on from a checkpoint's ``version`` and histogram: every client has seen it."""
        self.version = int(version)
        self.staleness = collections.Counter({int(k): int(v) for k, v in staleness.items()})
        for c in self.pulled:
            self.pulled[c] = self.version


def staleness_summary(histograms: list[dict]) -> dict:
    """The staleness of an asynchronous run, over every shard: ``histogram`` {staleness:
    updates}, ``updates``, ``max`` and ``mean`` over every shard's applications (an
    exchange split over ``k`` servers is ``k`` updates, one per shard), and ``shards``, the
    same for each server."""

    def one(hist: dict) -> dict:
        hist = {int(k): int(v) for k, v in hist.items()}
        updates = sum(hist.values())
        return {"histogram": {str(k): v for k, v in sorted(hist.items())}, "updates": updates,
                "max": max(hist) if hist else 0,
                "mean": sum(k * v for k, v in hist.items()) / updates if updates else 0.0}

    total: collections.Counter[int] = collections.Counter()
    for hist in histograms:
        total.update({int(k): int(v) for k, v in hist.items()})
    return {**one(dict(total)), "shards": [one(h) for h in histograms]}
