"""The periodic strategies' common ground: options (``--tau`` and the streaming flags) and
the base class whose rounds end with an exchange (local SGD, EASGD, EAMSGD, DiLoCo)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.core.comm import Comm
from shoal.core.flat import FlatParams
from shoal.core.hostpath import HELP, MODES, check_mode, use_host_memory
from shoal.core.intrahost import SharedReducer
from shoal.core.quantize import CHUNK, PRECISIONS, Codec, check_precision, error_feedback
from shoal.core.timeline import COMM
from shoal.errors import ShoalError
from shoal.strategies.base import Strategy
from shoal.strategies.communication import Exchange, Pattern
from shoal.strategies.period import AUTO_START, AdaptivePeriod, first_period, parse_period
from shoal.strategies.streaming import PATTERNS, Exchanges, Fragment, fragment_order


@dataclasses.dataclass
class PeriodicOptions:
    """Options of the strategies that exchange models every ``tau`` local steps."""

    tau: int | str = dataclasses.field(default=4, metadata={
        "help": "local steps between two exchanges; auto: AdaComm's adaptive period, from "
                f"auto:N steps (default {AUTO_START}) down as the loss falls",
        "parse": parse_period, "metavar": "N|auto[:N]", "kind": "an integer, auto or auto:N"})
    measure_wait: bool = dataclasses.field(default=False, metadata={
        "help": "book the time spent waiting for the slowest rank as wait, not comm "
                "(one tiny extra message per exchange)"})
    outer_precision: str = dataclasses.field(default="fp32", metadata={
        "help": f"what each exchange sends: {', '.join(PRECISIONS)} (int4: two values a byte)",
        "choices": PRECISIONS})
    error_feedback: str = dataclasses.field(default="auto", metadata={
        "help": "keep what compression dropped and send it next time: on, off, auto "
                "(on for fp8, int8, int4)", "choices": ("auto", "on", "off")})
    fragments: int = dataclasses.field(default=1, metadata={
        "help": "exchange the model in this many fragments at staggered steps (Streaming DiLoCo)"})
    overlap_steps: int = dataclasses.field(default=0, metadata={
        "help": "local steps an exchange travels behind before it is applied (< tau / fragments)"})
    fragment_pattern: str = dataclasses.field(default="sequential", metadata={
        "help": "which tensors form a fragment (Streaming DiLoCo's Figure 2): sequential, "
                "contiguous runs of tensors of about equal size; strided, the model's layers "
                "dealt round robin (fragment p: layers p, p+F, p+2F, ...)",
        "choices": PATTERNS})
    intra_host: str = dataclasses.field(default="auto", metadata={"help": HELP, "choices": MODES})
    host_sync: bool = dataclasses.field(default=False, metadata={
        "help": "one replica a host: its processes take every step together (their gradients "
                "averaged through the host's memory) and the strategy couples the hosts (needs "
                "--intra-host auto or shm)"})

    def validate(self) -> None:
        first_period(self.tau)
        check_mode(self.intra_host)
        if self.host_sync and self.intra_host == "gloo":
            raise ShoalError("--host-sync averages each host's gradients through its memory: "
                             "leave out --intra-host gloo")
        check_precision(self.outer_precision)
        error_feedback(self.outer_precision, self.error_feedback)
        if self.fragments < 1:
            raise ShoalError(f"--fragments must be at least 1, got {self.fragments}")
        if self.overlap_steps < 0:
            raise ShoalError(f"--overlap-steps must be at least 0, got {self.overlap_steps}")
        if self.fragments > 1 or self.overlap_steps > 0:
            if isinstance(self.tau, str):
                raise ShoalError("--fragments and --overlap-steps need a fixed --tau, not auto")
            if self.fragments > self.tau:
                raise ShoalError(f"--fragments {self.fragments} is more than --tau {self.tau}: "
                                 "at most one fragment starts after each step")
            if self.overlap_steps * self.fragments >= self.tau:
                raise ShoalError(f"--overlap-steps must be less than tau / fragments = "
                                 f"{self.tau}/{self.fragments}, got {self.overlap_steps}")



class PeriodicStrategy(Strategy):
    """Base of the strategies that step alone and :meth:`exchange` every ``tau`` steps
    (``--tau auto``: a period that adapts, :mod:`shoal.strategies.period`).

    A subclass says how to start an exchange of one fragment (:meth:`launch`) and how to
    apply its result (:meth:`complete`), and calls :meth:`stream` with its flat parameters,
    laid out by :meth:`fragment_order`; the whole model is one fragment unless
    ``--fragments`` says otherwise, and :mod:`shoal.strategies.streaming` schedules
    fragments, overlap and compression.
    """

    Options: ClassVar[type] = PeriodicOptions
    replicas_in_sync: ClassVar[bool] = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 options: Any = None) -> None:
        super().__init__(model, optimizer, comm, options)
        self.period = first_period(self.options.tau)  #: local steps of the current round
        self.last_exchange = 0  #: the step that closed the last round
        self.adaptive = AdaptivePeriod(self.period, comm) \
            if isinstance(self.options.tau, str) else None
        self.exchanges: Exchanges | None = None
        summing = use_host_memory(comm, self.options.intra_host)  # its exchanges' sums
        #: ``--host-sync``: the reducer of this process's host, which averages its gradients
        self.host: SharedReducer | None = None
        if self.options.host_sync and comm.active:
            if summing is None:
                raise ShoalError("--host-sync needs the host's shared memory, which this job "
                                 "cannot take (--elastic, GPUs, or the line above says why)")
            self.host = summing.within_host()

    @classmethod
    def outer_pattern(cls, options: PeriodicOptions, workers: int, what: str,
                      hidden: bool = False) -> Pattern:
        """The cost model's pattern of an exchange of ``what`` every ``tau`` steps (its first,
        for ``--tau auto``) in ``--outer-precision``: its messages' bytes relative to float32
        (a chunk's codes and scale); a precision that cannot be summed is all-gathered, and a
        ring all-gather of ``m`` bytes a worker sends what a ring all-reduce of ``workers * m / 2``
        does."""
        codec = Codec(options.outer_precision)
        size = codec.payload_bytes(CHUNK) / (4 * CHUNK)
        if not codec.reduces:
            size *= max(workers, 2) / 2
        return Pattern(Exchange.ALL_REDUCE, what, every=first_period(options.tau), size=size,
                       hidden=hidden, fragments=options.fragments, overlap=options.overlap_steps)

    def fragment_order(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` (the strategy's parameter order) as its flat vectors must hold them:
        fragment by fragment, so that each fragment is one slice (``--fragment-pattern
        strided`` moves layers; sequential keeps the order)."""
        o = self.options
        return fragment_order(self.model, params, o.fragments, o.fragment_pattern)

    def stream(self, flat: FlatParams) -> Exchanges:
        """Exchange ``flat``'s tensors (laid out by :meth:`fragment_order`) as the options say."""
        self.exchanges = Exchanges(flat, self.options, self.comm, self.model)
        return self.exchanges

    @property
    def in_round(self) -> bool:
        """Whether local steps were taken since the last round closed (an epoch's end then
        exchanges once more)."""
        return self.steps > self.last_exchange

    def meets_after(self, step: int) -> bool:
        return step == self.last_exchange

    def steps_uncounted(self) -> int:
        """Streaming: the steps since the fragment exchanged longest ago last started (its
        exchange carries no later step's work); else none, after a meeting."""
        ex = self.exchanges
        return self.steps - min(ex.launched) if ex is not None and ex.streaming else 0

    def backward(self, loss: torch.Tensor) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(loss)
        super().backward(loss)

    def step(self) -> None:
        if self.exchanges is None and self._streams_asked():
            raise ShoalError(f"strategy {self.name} exchanges whole models in fp32 only: it takes "
                             "no --fragments, --overlap-steps or --outer-precision")
        if self.host is not None:
            self._average_on_host()
        super().step()
        if self.adaptive is not None:
            self.adaptive.step_done()
        if self.exchanges is not None and self.exchanges.streaming:
            self._stream_step()
        elif self.steps - self.last_exchange >= self.period:
            if self.options.measure_wait:
                self.comm.barrier()  # a straggler's lead is booked as wait, not as transfer
            self.exchange()
            self.last_exchange = self.steps
            if self.adaptive is not None:
                self.period = self.adaptive.next_period(float(self.optimizer.param_groups[0]["lr"]))

    @torch.no_grad()
    def _average_on_host(self) -> None:
        """``--host-sync``: every process of this host steps from the mean gradient over
        the host's rows (each process's mean weighed by its rows: an uneven last batch
        too), so that they stay one replica."""
        assert self.host is not None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        rows = float(self.batch_share[0]) if self.batch_share is not None else 1.0
        flat = torch._utils._flatten_dense_tensors(grads)
        flat = torch.cat([flat.mul_(rows), flat.new_full((1,), rows)])
        self.comm.count(flat.numel() * flat.element_size())
        with self.comm.timeline.span(COMM, "host gradients"):
            self.host.all_reduce(flat)
        mean = flat[:-1].div_(flat[-1])
        for g, m in zip(grads, torch._utils._unflatten_dense_tensors(mean, grads), strict=True):
            g.copy_(m)

    def _streams_asked(self) -> bool:
        o = self.options
        return o.fragments > 1 or o.overlap_steps > 0 or o.outer_precision != "fp32"

    def _stream_step(self) -> None:
        """Start the exchanges due to start after this step, then apply those due."""
        ex = self.exchanges
        starting = ex.starting_after(self.steps)
        if starting and self.options.measure_wait:
            self.comm.barrier()
        for fragment in starting:
            ex.pending[fragment.index] = (self.steps, self.steps + ex.overlap, self.launch(fragment))
            ex.launched[fragment.index] = self.last_exchange = self.steps
        for p in sorted(p for p, (_, due, _) in ex.pending.items() if due <= self.steps):
            self._complete_pending(p)

    def _complete_pending(self, p: int) -> None:
        start, _, kept = self.exchanges.pending.pop(p)
        self.complete(self.exchanges.fragments[p], kept, moved=self.steps > start)

    def exchange(self) -> None:
        """Communicate: called after the last local step of every round (``tau`` steps), one
        exchange of the whole model applied at once."""
        whole = self.exchanges.fragments[0]
        self.complete(whole, self.launch(whole), moved=False)

    def launch(self, fragment: Fragment) -> dict[str, Any]:
        """Start ``fragment``'s exchange; returns what :meth:`complete` needs (the key
        ``exchange``: the exchange in flight, whose ``wait()`` gives its result)."""
        raise NotImplementedError

    def complete(self, fragment: Fragment, kept: dict[str, Any], moved: bool) -> None:
        """Apply ``fragment``'s exchange; ``moved``: local steps were taken since it started."""
        raise NotImplementedError

    def drain(self) -> None:
        """Apply every exchange in flight now."""
        if self.exchanges is not None:
            for p in sorted(self.exchanges.pending):
                self._complete_pending(p)

    def close_rounds(self) -> None:
        """At an epoch's end: apply every exchange in flight, then exchange (at once) every
        fragment that took local steps since it last started one."""
        ex = self.exchanges
        if ex is None or not ex.streaming:
            if self.in_round:
                self.exchange()
            return
        self.drain()
        for fragment in ex.fragments:
            if self.steps > ex.launched[fragment.index]:
                self.complete(fragment, self.launch(fragment), moved=False)
                ex.launched[fragment.index] = self.steps
        self.last_exchange = self.steps

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "last_exchange": self.last_exchange}
        if self.adaptive is not None:
            state["period"] = self.adaptive.state_dict()
        if self.exchanges is not None and (self.exchanges.streaming
                                           or self.exchanges.residual is not None):
            state["exchanges"] = self.exchanges.state_dict()
        return state

    def handover_state(self) -> dict[str, Any]:
        """A joiner starts with no error-feedback residual: what compression dropped is each
        rank's own to send, and a copy of this rank's would send it twice."""
        state = self.state_dict()
        if "exchanges" in state:
            state["exchanges"] = {**state["exchanges"], "residual": None}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # A checkpoint of a fixed period from before the rounds were kept: its multiples.
        self.last_exchange = int(state.get("last_exchange",
                                           self.steps - self.steps % self.period))
        if self.adaptive is not None and "period" in state:
            self.adaptive.load_state_dict(state["period"])
            self.period = self.adaptive.period
        if self.exchanges is not None and "exchanges" in state:
            self.exchanges.load_state_dict(state["exchanges"])
