"""The cost model: a strategy's communication pattern, a step's compute and a network, turned
into time. One model, three users: ``shoal plan --simulate`` (:mod:`shoal.plan.simulate`,
clusters that cannot be run here), the planner's estimate of a trial not yet run
(:meth:`shoal.plan.planner.Planner.estimate`, from what a tested trial measured) and through
it the search's expected cost of a trial (:meth:`shoal.plan.search.Omnivore.expected_cost`).

An alpha-beta model (Hockney): a message of ``n`` bytes costs ``alpha + n * beta``, where
``alpha`` is the latency of a message and ``1 / beta`` the bandwidth of a node's link (each
way). A worker's step is its compute ``c`` plus what its pattern
(:class:`~shoal.strategies.communication.Pattern`, stated by each strategy) exposes:

- an all-reduce (:attr:`~Exchange.ALL_REDUCE`) of ``n`` bytes over ``p`` workers is a ring,
  ``R(p) = 2 (p - 1) / p * n * beta + 2 (p - 1) * alpha``, every ``tau`` steps; a round of
  ``tau`` steps takes ``tau c + R(p)``, or ``c + max((tau - 1) c, R(p))`` when the
  exchange is hidden behind the round's other steps (EASGD's overlap);
- a push and pull through servers (:attr:`~Exchange.SERVER`): ``2 alpha + 2 n beta``
  through the worker's link, every ``tau`` steps. The ``k`` servers' links carry every
  pusher's traffic, ``n / k`` bytes per shard and direction per exchange, so they serve at
  most ``k / (n beta)`` exchanges per second: when the pushers ask for more, they queue and
  a pusher's cycle becomes ``pushers * n * beta / k``;
- compute groups (:attr:`~Exchange.GROUP_SERVER`, ``g`` groups of ``s = p / g``): a ring
  all-reduce inside the group, the leader's push and pull (``g`` pushers), and the group's
  broadcast of the parameters, ``B(s) = n beta + ceil(log2 s) alpha``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import ShoalError
from shoal.strategies.communication import Exchange, Pattern


# -- the formulas -----------------------------------------------------------------------------
def ring_allreduce_s(p: int, nbytes: float, beta: float, alpha: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``p`` nodes: ``2 (p-1)/p * nbytes * beta +
    2 (p-1) * alpha`` (reduce-scatter then all-gather, ``p - 1`` messages each)."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) / p * nbytes * beta + 2 * (p - 1) * alpha


def broadcast_s(p: int, nbytes: float, beta: float, alpha: float) -> float:
    """A (pipelined) broadcast of ``nbytes`` to ``p`` nodes: ``nbytes * beta +
    ceil(log2 p) * alpha``."""
    if p <= 1:
        return 0.0
    return nbytes * beta + math.ceil(math.log2(p)) * alpha


def exchange_s(nbytes: float, beta: float, alpha: float) -> float:
    """One worker's push and pull of the flat vector with nobody else in the way:
    ``2 alpha + 2 nbytes beta`` (its own link carries all of it, however many shards)."""
    return 2 * alpha + 2 * nbytes * beta


def server_cycle_s(pushers: int, nbytes: float, beta: float, servers: int) -> float:
    """The shortest time between two exchanges of one pusher when the servers' links are
    saturated: ``pushers`` exchanges of ``nbytes / servers`` per shard and direction."""
    return pushers * nbytes * beta / servers


# -- what the model is given ------------------------------------------------------------------
@dataclass
class Calibration:
    """What this machine measured: compute per sample of the model (with ``threads``
    threads per worker), and a local Gloo all-reduce's latency and bandwidth."""

    compute_s_per_sample: float
    threads: int
    alpha_host_s: float  #: latency of a message between two local processes
    host_bytes_per_s: float  #: bytes per second between two local processes (loopback)
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    source: str = "measured"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str) -> Calibration:
        """A calibration from a file (``simulate.json``'s ``calibration`` or the same
        keys at the top level); a one-line error naming ``source`` otherwise."""
        values = values.get("calibration", values)
        need = ("compute_s_per_sample", "threads", "alpha_host_s", "host_bytes_per_s")
        try:
            numbers = {k: float(values[k]) for k in need}
        except (KeyError, TypeError, ValueError):
            raise ShoalError(f"{source}: a calibration needs numbers {', '.join(need)}") from None
        if not all(math.isfinite(v) and v >= 0 for v in numbers.values()) \
                or numbers["host_bytes_per_s"] <= 0 or numbers["compute_s_per_sample"] <= 0:
            raise ShoalError(f"{source}: calibration values must be positive numbers")
        return cls(numbers["compute_s_per_sample"], max(1, int(numbers["threads"])),
                   numbers["alpha_host_s"], numbers["host_bytes_per_s"],
                   int(values.get("cores", len(os.sched_getaffinity(0)))), source)


@dataclass(frozen=True)
class Link:
    """What a message costs: ``alpha`` seconds, plus ``beta`` seconds per byte."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class Network:
    """Each node's link: ``bytes_per_s`` each way (``None``: no link, the processes of this
    machine, whose calibrated cost is the whole cost) and ``latency_s`` per message.
    ``host_cost``: add this machine's calibrated endpoint cost (latency and per-byte time of
    Gloo between two local processes) to the link's, as when the nodes are processes of this
    machine behind an emulated link; off, a given link is taken at its nominal values."""

    bytes_per_s: float | None = None
    latency_s: float = 0.0
    host_cost: bool = False

    @property
    def _host(self) -> bool:
        return self.host_cost or not self.bytes_per_s

    def alpha(self, cal: Calibration) -> float:
        """Seconds per message."""
        return self.latency_s + (cal.alpha_host_s if self._host else 0.0)

    def beta(self, cal: Calibration) -> float:
        """Seconds per byte."""
        link = 1.0 / self.bytes_per_s if self.bytes_per_s else 0.0
        return link + (1.0 / cal.host_bytes_per_s if self._host else 0.0)

    def link(self, cal: Calibration) -> Link:
        return Link(self.alpha(cal), self.beta(cal))


# -- a step -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCost:
    """A worker's average step: its time, of which compute, what limits it (compute, network
    or server) and the bytes it sends, on average."""

    step_s: float
    compute_s: float
    bound: str
    bytes_per_step: float


def pattern_of(strategy: str, options: dict[str, Any], workers: int) -> Pattern | None:
    """The pattern of ``strategy`` with ``options`` (checked) on ``workers`` workers."""
    from shoal.strategies import get_strategy, make_options

    cls = get_strategy(strategy)
    return cls.communication(make_options(cls, options), workers)


def step_cost(pattern: Pattern, nodes: int, compute_s: float, nbytes: float, link: Link) -> StepCost:
    """A worker's average step when ``nodes`` workers, each computing ``compute_s`` a step,
    exchange as ``pattern`` says a model of ``nbytes`` bytes over ``link``."""
    n = nbytes * pattern.size
    if pattern.exchange is Exchange.ALL_REDUCE:
        step, sent, bound = _all_reduce(pattern, nodes, compute_s, n, link)
    elif pattern.exchange is Exchange.SERVER:
        step, sent, bound = _through_servers(pattern, nodes, compute_s, n, link)
    else:
        step, sent, bound = _groups(pattern, nodes, compute_s, n, link)
    if bound == "compute" and step - compute_s > compute_s:
        bound = "network"
    return StepCost(step, compute_s, bound, sent)


def _all_reduce(pattern: Pattern, p: int, c: float, n: float, link: Link
                ) -> tuple[float, float, str]:
    tau = pattern.every
    ring = ring_allreduce_s(p, n, link.beta, link.alpha)
    round_s = c + max((tau - 1) * c, ring) if pattern.hidden else tau * c + ring
    sent = 2 * (p - 1) / p * n / tau
    return round_s / tau, sent, "compute"


def _through_servers(pattern: Pattern, p: int, c: float, n: float, link: Link
                     ) -> tuple[float, float, str]:
    tau = pattern.every
    free = tau * c + exchange_s(n, link.beta, link.alpha)
    busy = server_cycle_s(pattern.pushers, n, link.beta, pattern.servers)
    return max(free, busy) / tau, n / tau, "server" if busy > free else "compute"


def _groups(pattern: Pattern, p: int, c: float, n: float, link: Link) -> tuple[float, float, str]:
    size = math.ceil(p / pattern.groups)
    inside = ring_allreduce_s(size, n, link.beta, link.alpha) \
        + broadcast_s(size, n, link.beta, link.alpha)
    free = c + inside + exchange_s(n, link.beta, link.alpha)
    busy = server_cycle_s(pattern.pushers, n, link.beta, pattern.servers)
    sent = 2 * (size - 1) / size * n + 2 * n / size  # the leader's push and broadcast, shared
    return max(free, busy), sent, "server" if busy > free else "compute"


def fitted_link(pattern: Pattern, nodes: int, comm_s: float) -> Link:
    """The link (per model: ``beta`` in seconds per model's bytes, no latency) on which
    ``pattern`` on ``nodes`` workers communicates ``comm_s`` a step, as a tested trial
    measured; a pattern that sends nothing there (one worker) fits a free link."""
    unit = step_cost(pattern, nodes, 0.0, 1.0, Link(0.0, 1.0)).step_s
    return Link(0.0, comm_s / unit if unit > 0 else 0.0)
