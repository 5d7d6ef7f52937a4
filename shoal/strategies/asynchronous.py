"""The asynchronous strategies' common ground: workers that never wait for each other.

A worker of an asynchronous strategy talks only to the parameter server(s) that hold the
shared vector (the parameters of ``async-sgd``/``async-msgd``, the center ``x~`` of the
elastic ones), through ``comm.ps`` (a :class:`~shoal.core.pairs.Client`: the
:class:`~shoal.ps.client.ServerClient` of a job started by ``shoal train``), which books each
exchange on the worker's Comm. Every message is one flat vector laid out as
:func:`~shoal.strategies.easgd.parameter_order` (each optimizer group one contiguous slice),
split over the servers in contiguous ranges by the client.

A strategy class says what runs where:

- the worker: :meth:`AsyncStrategy.step` (its own update, and an exchange when one is due);
- the server: :attr:`AsyncStrategy.Rule`, built by each server process as
  ``Rule(center_shard, options)`` for its shard; it implements
  :class:`~shoal.ps.rule.ServerRule`: ``apply(header, payload, reply)`` for each EXCHANGE,
  in the order the options' :class:`~shoal.ps.admission.Admission` lets them through, under
  the shard's lock unless ``locked`` is False.

A rule names the values it reads in ``fields`` (``("lr", "momentum", "weight_decay")``,
``("alpha",)``); each message's header carries them (:meth:`AsyncStrategy.header`): an
optimizer setting of the worker's first group at that step, so learning-rate schedules apply
on the server as they would locally, or else the strategy's attribute of that name (the
elastic moving rate ``alpha``).

Every strategy here can be built without a server (``comm.ps`` is ``None``: the preflight
check, ``shoal.strategy`` in a job that has none); only :meth:`AsyncStrategy.step` then says
that it needs one. Built with a server, a worker starts from the server's vector (a PULL);
without one, in a job of several processes, from rank 0's model, as every shoal strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from shoal.core import Client, FlatParams, Header, Kind
from shoal.core.hostpath import HELP, MODES, check_mode
from shoal.errors import ShoalError
from shoal.ps.admission import ORDERS, Admission, check_settings
from shoal.schema import flag_name
from shoal.strategies.base import Strategy
from shoal.strategies.capabilities import AdmittingOptions, NamedFields, ServedOptions
from shoal.strategies.communication import Exchange, Pattern
from shoal.strategies.easgd import parameter_order
from shoal.strategies.topology import Topology

if TYPE_CHECKING:
    from shoal.core.comm import Comm
    from shoal.ps.rule import ServerRule

@dataclasses.dataclass
class AsyncOptions:
    """The parameter server's settings, shared by every asynchronous strategy. The server
    processes read them; they are checked here, before any worker starts."""

    servers: int = dataclasses.field(default=1, metadata={
        "help": "parameter-server processes, each holding one contiguous shard of the vector"})
    max_staleness: int | None = dataclasses.field(default=None, metadata={
        "help": "hold a worker's exchange while it would leave another worker more than this "
                "many server versions behind (at least workers - 1; default: no bound)"})
    intra_host: str = dataclasses.field(default="auto", metadata={"help": HELP, "choices": MODES})

    #: What one of the clients that push exchanges is called (in messages).
    pusher: ClassVar[str] = "worker"

    @property
    def order(self) -> str:
        """The order in which the server takes exchanges: arrival (first come, first served)."""
        return "arrival"

    def validate(self) -> None:
        if self.servers < 1:
            raise ShoalError(f"{flag_name('servers')} must be at least 1, got {self.servers}")
        check_mode(self.intra_host)
        check_settings(self.order, self.max_staleness)

    def pushers(self, workers: int) -> list[int]:
        """The workers that push exchanges to the servers: all of them, unless a strategy's
        workers share one push (as a compute group's do)."""
        return list(range(workers))

    def admission(self, workers: int) -> Admission:
        """When the servers apply the exchanges of ``workers`` workers (order, staleness
        bound); building it checks that the bound lets every pusher through."""
        return Admission(tuple(self.pushers(workers)), self.order, self.max_staleness,
                         self.pusher)

    def check_workers(self, workers: int) -> None:
        """The staleness bound must let every pusher through: while one waits, the others
        may each push once (round robin needs exactly that)."""
        self.admission(workers)


@dataclasses.dataclass
class AsyncElasticOptions(AsyncOptions):
    """Options of the asynchronous elastic strategies (Zhang et al. 2015, Algorithms 1-2)."""

    #: The orders this strategy's server may take exchanges in.
    orders: ClassVar[tuple[str, ...]] = ("arrival",)

    tau: int = dataclasses.field(default=1, metadata={
        "help": "local steps between two exchanges (default 1; 4 or more where the link is "
                "slow)"})
    alpha: float | None = dataclasses.field(default=None, metadata={
        "help": "elastic moving rate (default 0.9 / workers)"})
    order: str = dataclasses.field(default="arrival", metadata={  # type: ignore[assignment]
        "help": "the order the server takes exchanges in: arrival (first come, first served) "
                "or round-robin (the original EASGD master; async-easgd only)",
        "choices": ORDERS})

    def validate(self) -> None:
        super().validate()
        if self.tau < 1:
            raise ShoalError(f"{flag_name('tau')} must be at least 1, got {self.tau}")
        if self.alpha is not None and not 0 <= self.alpha <= 1:
            raise ShoalError(f"{flag_name('alpha')} must be in [0, 1], got {self.alpha}")
        if self.order not in self.orders:
            raise ShoalError(f"{flag_name('order')} {self.order} is async-easgd's alone (the "
                             "original EASGD's round-robin master); this strategy's server "
                             "takes exchanges in arrival order")

    def moving_rate(self, workers: int) -> float:
        """``alpha``: as given, or the paper's ``beta = 0.9`` spread over the workers. Each
        center update is one worker's, ``x~ <- (1 - alpha) x~ + alpha x^i``: a convex
        combination for any alpha in [0, 1], so no bound on ``alpha * workers`` applies."""
        return self.alpha if self.alpha is not None else 0.9 / workers

    def settings(self, workers: int) -> dict[str, Any]:
        """The coupling as the run takes it, for its first line and ``config.json``."""
        return {"tau": self.tau, "alpha": round(self.moving_rate(workers), 12)}


def detached(strategy: Strategy) -> AsyncStrategy:
    """``strategy``, a detached worker's (it exchanges with parameter servers), typed so.

    Raises:
        TypeError: it is not an asynchronous strategy (a job with servers runs only those).
    """
    if not isinstance(strategy, AsyncStrategy):
        raise TypeError(f"{type(strategy).__name__} is not an asynchronous strategy")
    return strategy


class AsyncStrategy(Strategy):
    """Base of the asynchronous strategies: a worker that exchanges with parameter servers.

    Subclasses implement :meth:`update` (this worker's step ``t``, with its exchange when one
    is due) and set :attr:`Rule` (the server's update, ``None``: no server rule).
    """

    Options: ClassVar[type] = AsyncOptions
    #: The workers step one parameter vector in one host's memory (hogwild): the coordinator
    #: creates it as a shared file.
    shared_memory: ClassVar[bool] = False
    replicas_in_sync: ClassVar[bool] = False
    #: What a server applies to its shard: ``Rule(center_shard, options)`` is a
    #: :class:`~shoal.ps.rule.ServerRule`.
    Rule: ClassVar[Callable[[torch.Tensor, Any], ServerRule] | None] = None
    #: A step's exchange carries that step's own work (a gradient pushed); False: it carries
    #: the steps before (the elastic ones send ``x`` before their local step).
    carries_step: ClassVar[bool] = True
    #: Its workers train in compute groups (``groups``): a group's batches are one.
    grouped: ClassVar[bool] = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 options: Any = None) -> None:
        super().__init__(model, optimizer, comm, options)
        self.flat = FlatParams(parameter_order(model, optimizer))
        servers = self.servers(self.options)
        if servers > self.flat.numel:
            raise ShoalError(f"{flag_name('servers')} {servers}: the model has {self.flat.numel} "
                             "parameters, and each server holds one at least")
        self.clock = 0  # exchanges this worker has made with the servers
        self.samples = 0  # samples this worker has trained on (its shares of the batches)
        self.carried = 0  # samples whose work the next exchange carries (its header's)
        self.counted = 0  # samples whose work an exchange has carried to the servers
        #: The trainer's batches are a compute group's and its global rows what an exchange
        #: carries (``groups`` under ``--elastic``: each member reads its part of them).
        self.group_batches = False
        self._host_buffers: dict[str, torch.Tensor] = {}  # a GPU model's messages, on the host
        self.start()

    # -- the server ---------------------------------------------------------------------------
    @property
    def client(self) -> Client | None:
        """``comm.ps``: this worker's end of the parameter servers, or ``None``."""
        return self.comm.ps

    @classmethod
    def servers(cls, options: Any) -> int:
        """``--servers`` (1 for a strategy without the option)."""
        return int(options.servers) if isinstance(options, ServedOptions) else 1

    @classmethod
    def topology(cls, options: Any, workers: int) -> Topology:
        """The servers first, then the workers, each on its own: they meet only through the
        servers (and server 0 keeps the run's records from their reports)."""
        return Topology(workers, cls.servers(options),
                        tuple((w, w + 1) for w in range(workers)), cls.shared_memory)

    @classmethod
    def admission(cls, options: Any, workers: int) -> Admission:
        """When the servers apply the exchanges of ``workers`` workers: the options' (the
        order, the staleness bound, the pushers), or every worker in arrival order."""
        if isinstance(options, AdmittingOptions):
            return options.admission(workers)
        return Admission(tuple(range(workers)))

    @classmethod
    def through_servers(cls, options: Any, workers: int, what: str, every: int = 1) -> Pattern:
        """The pattern of a push of ``what`` and a pull of the reply every ``every`` steps,
        by each of the pushers (:meth:`admission`'s), to ``--servers`` servers."""
        return Pattern(Exchange.SERVER, what, every=every, servers=options.servers,
                       pushers=len(cls.admission(options, workers).pushers))

    def server(self) -> Client:
        """:attr:`client`, which must exist."""
        client = self.client
        if client is None:
            raise ShoalError(f"strategy {self.name} trains through a parameter server, and this "
                             "job has none: run it with shoal train (or give its Comm a "
                             "client of the servers as comm.ps)")
        return client

    def header(self, kind: int) -> Header:
        """The header of a message: where this worker stands and, for an exchange, the
        values of the fields the server's rule reads. The client fills in ``version``."""
        return Header(kind=kind, client=self.comm.rank, clock=self.clock, step=self.steps,
                      samples=self.carried if kind == Kind.EXCHANGE else self.samples,
                      fields=self.rule_fields() if kind == Kind.EXCHANGE else {})

    def rule_fields(self) -> dict[str, float]:
        """Each field of ``Rule.fields``: the optimizer setting of that name in the first
        group at this step (so schedules apply on the server), else this strategy's
        attribute of that name."""
        group, values = self.optimizer.param_groups[0], {}
        for name in self.Rule.fields if isinstance(self.Rule, NamedFields) else ():
            value = group[name] if name in group else getattr(self, name, None)
            if value is None:
                raise ShoalError(f"strategy {self.name}'s server rule reads {name!r}, which is "
                                 "neither an optimizer setting nor an attribute of the strategy")
            values[name] = float(value)
        return values

    def seat(self) -> tuple[int, int]:
        """The workers that train as this one, ``(first, end)``: itself alone."""
        return self.comm.rank, self.comm.rank + 1

    def go_on_from(self, position: int) -> None:
        """Resumed from the center at ``position`` samples of its schedule: all counted."""
        self.samples = self.carried = self.counted = position

    @torch.no_grad()
    def start(self) -> None:
        """Start from the server's vector (one PULL) or, without a server in a job of several
        processes, from rank 0's model."""
        client = self.client
        if client is not None:
            self.pull()
        elif self.comm.active:
            self.comm.broadcast(self.flat.pack(), src=0, name="start")
            self.flat.unpack()

    @torch.no_grad()
    def pull(self) -> None:
        """Set the parameters to the server's vector."""
        reply = self._host(self.flat.buffer, "reply")
        self.server().pull(reply, self.header(Kind.PULL))
        if reply is not self.flat.buffer:
            self.flat.buffer.copy_(reply)
        self.flat.unpack()

    @torch.no_grad()
    def exchange(self, payload: torch.Tensor, reply: torch.Tensor) -> None:
        """Send ``payload`` (the full flat vector) and receive the servers' ``reply``. The
        servers hold their shards in host memory: a model on a GPU exchanges through host
        buffers of this worker's."""
        sent, back = self._host(payload, "payload"), self._host(reply, "reply")
        if sent is not payload:
            sent.copy_(payload)
        self.server().exchange(sent, back, self.header(Kind.EXCHANGE))
        if back is not reply:
            reply.copy_(back)
        self.clock += 1
        self.counted = self.carried

    def _host(self, tensor: torch.Tensor, role: str) -> torch.Tensor:
        """``tensor`` itself on the CPU, else this worker's (pinned) host buffer for ``role``."""
        if tensor.device.type == "cpu":
            return tensor
        buffer = self._host_buffers.get(role)
        if buffer is None or buffer.numel() != tensor.numel() or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.numel(), dtype=tensor.dtype,
                                 pin_memory=torch.cuda.is_available())
            self._host_buffers[role] = buffer
        return buffer

    # -- the training step --------------------------------------------------------------------
    def step(self) -> None:
        """This worker's step: :meth:`update` with the step's index ``t`` (0 first)."""
        self.server()
        t = self.steps
        self.steps += 1
        before = self.samples
        if self.batch_share is not None:
            self.samples += int(self.batch_share[1 if self.group_batches else 0])
        self.carried = self.samples if self.carries_step else before
        self.update(t)

    def flush(self) -> None:
        """Carry the work not yet sent to the servers (``--elastic``, at a worker's end, so
        that all it trained counts): nothing where every step's exchange carries its own."""

    def update(self, t: int) -> None:
        """This worker's update at its local step ``t``."""
        raise NotImplementedError

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Steps, exchanges, samples and the server versions last seen (per server)."""
        versions = self.client.versions if self.client is not None else None
        return {**super().state_dict(), "clock": self.clock, "samples": self.samples,
                "versions": list(versions) if versions is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.clock = int(state.get("clock", 0))
        self.samples = int(state.get("samples", 0))
        # The versions this worker's information dates from, for the staleness of its next
        # exchange; never past what the (restored) servers told it when it was made.
        client = self.client
        versions, mine = state.get("versions"), client.versions if client is not None else None
        if versions is not None and mine is not None and len(mine) == len(versions):
            mine[:] = [min(int(v), int(m)) for v, m in zip(versions, mine, strict=True)]

    def restore_checkpoint(self, shared: dict[str, Any], own: dict[str, Any] | None) -> None:
        """Put back this worker's model, optimizer and strategy state; a worker the
        checkpoint has no state of starts from its model (the center), with a fresh
        optimizer. Then :meth:`restored`."""
        if own is None:
            self.model.load_state_dict(shared["model"])
        else:
            self.model.load_state_dict(own["model"])
            self.optimizer.load_state_dict(own["optimizer"])
            self.load_state_dict(own["strategy"])
        self.restored(own is not None)

    @torch.no_grad()
    def rejoin(self) -> None:
        """Back from a rest (``--elastic``: done, then dealt more work): start again from
        the servers' vector, as a worker new to a checkpoint does."""
        self.pull()
        self.restored(False)

    def restored(self, own: bool) -> None:
        """After :meth:`restore_checkpoint` (``own``: this worker's state was in it)."""


def check_server_sgd(name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                     momentum: bool) -> None:
    """The optimizer a server's SGD takes its settings from: ``torch.optim.SGD`` stepping
    every parameter, minimizing, and (``momentum``) heavy-ball momentum without dampening
    or Nesterov."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ShoalError(f"{name}'s server applies SGD steps; the optimizer must be SGD, "
                         f"not {type(optimizer).__name__}")
    order = parameter_order(model, optimizer)
    stepped = sum(len(g["params"]) for g in optimizer.param_groups)
    if stepped != len(order):
        raise ShoalError(f"{name}'s server steps every parameter; the optimizer leaves "
                         f"{len(order) - stepped} of the model's out")
    for group in optimizer.param_groups:
        if group.get("maximize"):
            raise ShoalError(f"{name} minimizes; SGD(maximize=True) is not supported")
        if momentum and (group["nesterov"] or group["dampening"] != 0):
            raise ShoalError(f"{name}'s server applies heavy-ball momentum: no --nesterov "
                             "(and no dampening)")


def one_setting(name: str, optimizer: torch.optim.Optimizer) -> None:
    """The server applies one learning rate, momentum and weight decay to the whole vector:
    every optimizer group must have the same (checked at each step, as schedules may part
    them)."""
    groups = optimizer.param_groups
    if len(groups) == 1:
        return
    keys = ("lr", "momentum", "weight_decay")
    first = tuple(float(groups[0][k]) for k in keys)
    for group in groups[1:]:
        other = tuple(float(group[k]) for k in keys)
        if other != first:
            raise ShoalError(f"{name}'s server applies one learning rate, momentum and weight "
                             f"decay to all parameters, but the optimizer's groups differ "
                             f"(lr, momentum, weight decay {first} and {other})")
