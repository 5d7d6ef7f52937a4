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
  exchange is hidden behind the round's other steps (EASGD's overlap); streamed in ``F``
  fragments, each waited for ``H`` steps after it began, a round takes
  ``tau c + F max(0, w + R_F(p) - H c)``, ``R_F`` the ring of ``n / F`` bytes and ``w`` the
  wait for the slowest worker at each fragment's start;
- a push and pull through servers (:attr:`~Exchange.SERVER`): ``2 alpha + 2 n beta``
  through the worker's link, every ``tau`` steps. The ``k`` servers' links carry every
  pusher's traffic, ``n / k`` bytes per shard and direction per exchange, so they serve at
  most ``k / (n beta)`` exchanges per second: when the pushers ask for more, they queue and
  a pusher's cycle becomes ``pushers * n * beta / k``;
- compute groups (:attr:`~Exchange.GROUP_SERVER`, ``g`` groups of ``s = p / g``): a ring
  all-reduce inside the group, the leader's push and pull (``g`` pushers), and the group's
  broadcast of the parameters, ``B(s) = n beta + ceil(log2 s) alpha``.

A server's own work on an exchange (applying its rule) is ``server_work * beta_host`` per
byte of its shard, on the exchange's path and in the servers' queue. Three things of the
machines (:class:`Machine`, :class:`Link`) matter when nodes share one machine, as the
emulated cluster's do: processes on shared cores (synchronous workers compute together on
their share of the cores; asynchronous ones drift apart, so the cores hold them back only
when all their work does not fit), the ``contention`` of processes computing side by side,
and a link's token bucket (``tbf``'s ``burst``: a link idle long enough passes that many
bytes at once).
"""

from __future__ import annotations

import dataclasses
import functools
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


@functools.lru_cache(maxsize=256)
def slowest(p: int) -> float:
    """The expected largest of ``p`` standard normal draws (0 for one, 0.56 for two, 1.03
    for four): how far, in standard deviations, the slowest of ``p`` workers is behind the
    mean when they meet."""
    if p <= 1:
        return 0.0
    step, total = 0.01, 0.0
    for i in range(-800, 801):
        x = i * step
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * p * density * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (p - 1) * step
    return total


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
    """What a message costs: ``alpha`` seconds, plus ``beta`` seconds per byte, of which
    ``host_beta`` is the endpoints' own (their software, on their cores). A link with a token
    bucket of ``burst`` bytes (the emulated cluster's ``tbf``), idle long enough to refill it,
    passes that many bytes of a message at the endpoints' speed."""

    alpha: float
    beta: float
    burst: float = 0.0
    host_beta: float = 0.0

    def wire_s(self, nbytes: float, idle_s: float = math.inf) -> float:
        """The link's own time (beyond the endpoints') for ``nbytes`` one node sends in one
        exchange after ``idle_s`` seconds without sending: what its bucket, refilled at the
        link's rate meanwhile, does not hold."""
        per_byte = self.beta - self.host_beta
        held = min(self.burst, idle_s / per_byte) if per_byte > 0 else self.burst
        return max(0.0, nbytes - held) * per_byte


@dataclass(frozen=True)
class Network:
    """Each node's link: ``bytes_per_s`` each way (``None``: no link, the processes of this
    machine, whose calibrated cost is the whole cost) and ``latency_s`` per message.
    ``host_cost``: add this machine's calibrated endpoint cost (latency and per-byte time of
    Gloo between two local processes) to the link's, as when the nodes are processes of this
    machine behind an emulated link; off, a given link is taken at its nominal values.
    ``burst_bytes``: the link's token bucket (:func:`shoal.core.hostspec.burst_bytes`; a real link
    has none)."""

    bytes_per_s: float | None = None
    latency_s: float = 0.0
    host_cost: bool = False
    burst_bytes: float = 0.0

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
        host = 1.0 / cal.host_bytes_per_s if self._host else 0.0
        return Link(self.alpha(cal), self.beta(cal), self.burst_bytes if self.bytes_per_s else 0.0,
                    host)


@dataclass(frozen=True)
class Machine:
    """What the processes run on. ``cores``: every process of the job (workers and servers)
    shares one machine of that many cores (``None``: a machine per node, the servers' too);
    their computing and their messages' endpoint work then queue for those cores.
    ``contention``: how much slower a process computes while others compute beside it
    (cores that share caches, memory bandwidth or a physical core): 0.2 is 20%.
    ``noise``: how much a step's compute varies, its standard deviation over its mean
    (preemptions, other jobs): workers that meet wait for the slowest of them.
    ``server_work``: a server's own work on an exchange (applying its rule), per byte of
    its shard, in multiples of the endpoints' per-byte cost (``host_beta``; receiving and
    replying are theirs already). ``exchange_s``: what an exchange with the servers takes
    beyond its bytes' time and the rule's (its four messages' handling by the client's and
    the server's threads), seconds. benchmarks/bench_model.py fits them on the emulated
    cluster (docs/performance.md#cost-model: server work 0, an exchange 1 ms)."""

    cores: int | None = None
    contention: float = 0.0
    noise: float = 0.0
    server_work: float = 0.0
    exchange_s: float = 0.0


#: Every process on a machine of its own.
APART = Machine()


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


def step_cost(pattern: Pattern, nodes: int, compute_s: float, nbytes: float, link: Link,
              machine: Machine = APART) -> StepCost:
    """A worker's average step when ``nodes`` workers, each computing ``compute_s`` a step
    alone, exchange as ``pattern`` says a model of ``nbytes`` bytes over ``link``, on
    ``machine``."""
    n = nbytes * pattern.size
    c = compute_s * (1 + machine.contention if machine.cores and nodes > 1 else 1.0)
    share = max(1.0, nodes / machine.cores) if machine.cores else 1.0
    if pattern.exchange is Exchange.ALL_REDUCE:
        step, sent, bound = _all_reduce(pattern, nodes, c * share, n, link, share,
                                        machine.noise)
    else:
        work = machine.server_work * link.host_beta  # a server's seconds per byte of shard
        if pattern.exchange is Exchange.SERVER:
            path, busy, sent = _through_servers(pattern, c * share, n, link, work)
            path += machine.exchange_s / pattern.every
        else:
            path, busy, sent = _groups(pattern, nodes, c * share, n, link, work, machine.noise)
            path += machine.exchange_s
        # Asynchronous workers drift apart: one computes while another waits, so shared
        # cores hold the step back only when all of their work does not fit.
        cpu = _cpu_s(pattern, nodes, c, n, link, work) / machine.cores if machine.cores else 0.0
        step = max(path, busy, cpu)
        bound = "server" if busy > max(path, cpu) else "compute"
    if bound == "compute" and step - c * share > c * share:
        bound = "network"
    return StepCost(step, c * share, bound, sent)


def _all_reduce(pattern: Pattern, p: int, c: float, n: float, link: Link, share: float,
                noise: float) -> tuple[float, float, str]:
    """Synchronous workers compute together (``c``: on their share of the cores), then meet:
    each waits for the slowest (the round's compute varies by ``noise * c * sqrt(tau)``),
    and the ring's endpoint work waits for the cores too (``share``). A hidden exchange
    (started when the slowest comes) has the round's other steps to finish in."""
    tau = pattern.every
    sent = 2 * (p - 1) / p * n / tau
    if pattern.fragments > 1 or pattern.overlap:
        return _streamed_round(pattern, p, c, n, link, share, noise) / tau, sent, "compute"
    wait = slowest(p) * noise * c * math.sqrt(tau)
    if pattern.hidden:  # the link rests while the last step computes, or the round's others
        ring = _ring(p, n, link, share, max(c, tau * c - _ring(p, n, link, share, 0.0)))
        round_s = c + max((tau - 1) * c, wait + ring)
    else:
        round_s = tau * c + wait + _ring(p, n, link, share, tau * c + wait)
    return round_s / tau, sent, "compute"


def _streamed_round(pattern: Pattern, p: int, c: float, n: float, link: Link, share: float,
                    noise: float) -> float:
    """A streamed round: ``F`` all-reduces of ``n / F`` bytes a round of ``tau`` steps, ``tau / F``
    steps apart; each begins when the slowest worker comes (``tau / F`` steps' noise) and is
    waited for ``H`` steps later, exposing what of its wait and its ring those steps'
    compute does not hide."""
    tau, f, h = pattern.every, pattern.fragments, pattern.overlap
    wait = slowest(p) * noise * c * math.sqrt(tau / f)
    ring = _ring(p, n / f, link, share, tau * c / f)  # the link rests between fragments
    return tau * c + f * max(0.0, wait + ring - h * c)


def _ring(p: int, n: float, link: Link, share: float = 1.0, idle_s: float = math.inf) -> float:
    """A ring all-reduce of ``n`` bytes over ``p`` nodes on ``link`` (idle ``idle_s`` before
    it), its endpoints' work stretched by ``share`` (they wait for shared cores)."""
    if p <= 1:
        return 0.0
    return (ring_allreduce_s(p, n, link.host_beta, link.alpha) * share
            + link.wire_s(2 * (p - 1) / p * n, idle_s))


def _broadcast(p: int, n: float, link: Link, idle_s: float) -> float:
    return broadcast_s(p, n, link.host_beta, link.alpha) + (link.wire_s(n, idle_s) if p > 1
                                                            else 0.0)


def _exchange(n: float, link: Link, servers: int, work: float, idle_s: float) -> float:
    """A push and a pull of ``n`` bytes (each through its own bucket, idle ``idle_s``
    before), and the servers' ``work`` (seconds per byte) on their shards."""
    return (exchange_s(n, link.host_beta, link.alpha) + 2 * link.wire_s(n, idle_s)
            + work * n / servers)


def _through_servers(pattern: Pattern, c: float, n: float, link: Link, work: float
                     ) -> tuple[float, float, float]:
    """A pusher's step alone, the servers' least step (every pusher's shards through a
    server's link and its work on them, one exchange at a time) and the bytes sent."""
    tau = pattern.every
    free = (tau * c + _exchange(n, link, pattern.servers, work, tau * c)) / tau
    busy = server_cycle_s(pattern.pushers, n, link.beta + work, pattern.servers) / tau
    return free, busy, n / tau


def _groups(pattern: Pattern, p: int, c: float, n: float, link: Link, work: float,
            noise: float) -> tuple[float, float, float]:
    """As :func:`_through_servers`, for a group's leader: its group's all-reduce (waiting
    for the group's slowest, as in :func:`_all_reduce`) and broadcast on its path."""
    size = math.ceil(p / pattern.groups)
    wait = slowest(size) * noise * c
    free = c + wait + _ring(size, n, link, idle_s=c + wait) + _broadcast(size, n, link, c) \
        + _exchange(n, link, pattern.servers, work, c)
    busy = server_cycle_s(pattern.pushers, n, link.beta + work, pattern.servers)
    sent = 2 * (size - 1) / size * n + 2 * n / size  # the leader's push and broadcast, shared
    return free, busy, sent


def _cpu_s(pattern: Pattern, p: int, c: float, n: float, link: Link, work: float) -> float:
    """The cores' work of one step of every process: each worker's compute and its
    messages' endpoint work (a group's all-reduce and broadcast, a pusher's exchange), and
    the servers' (the exchanges' other ends, and their rule)."""
    exchanges = pattern.pushers / pattern.every  # per step, all pushers together
    size = math.ceil(p / pattern.groups) if pattern.exchange is Exchange.GROUP_SERVER else 1
    inside = ring_allreduce_s(size, n, link.host_beta, link.alpha) \
        + broadcast_s(size, n, link.host_beta, link.alpha)
    workers = p * (c + inside) + exchanges * exchange_s(n, link.host_beta, link.alpha)
    servers = exchanges * (exchange_s(n, link.host_beta, pattern.servers * link.alpha) + work * n)
    return workers + servers


def fitted_link(pattern: Pattern, nodes: int, comm_s: float) -> Link:
    """The link (per model: ``beta`` in seconds per model's bytes, no latency) on which
    ``pattern`` on ``nodes`` workers communicates ``comm_s`` a step, as a tested trial
    measured; a pattern that sends nothing there (one worker) fits a free link."""
    unit = step_cost(pattern, nodes, 0.0, 1.0, Link(0.0, 1.0)).step_s
    return Link(0.0, comm_s / unit if unit > 0 else 0.0)
