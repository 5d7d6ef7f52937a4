"""DiLoCo: local inner steps, then an outer Nesterov step on the averaged pseudo-gradient.

Douillard et al. (2023), "DiLoCo: Distributed Low-Communication Training of Language Models",
Algorithm 1, with ``H = tau`` inner steps per round ``t``::

    3:  theta_i <- theta^(t-1)                          every worker starts from the global model
    7:  theta_i <- InnerOpt(theta_i, grad L)  (H times)  the optimizer you configured (AdamW in the paper)
    9:  delta_i  = theta^(t-1) - theta_i
    11: Delta    = (1/k) sum_i delta_i                  the outer gradient: one all-reduce
    12: theta^(t) = OuterOpt(theta^(t-1), Delta)         Nesterov momentum (--outer-lr, --outer-momentum)

OuterOpt is Nesterov momentum (Sutskever et al. 2013: ``v <- mu v - lr grad(theta_S + mu v)``,
``theta_S <- theta_S + v``), with the gradient taken at the look-ahead point
``theta_S + mu v``; that point is the paper's ``theta`` (where every round starts, and the
model evaluated and saved). shoal steps it with ``torch.optim.SGD(nesterov=True)``, which
stores exactly that look-ahead point and, at the constant outer learning rate, moves it as
Sutskever's form does (tests/test_strategy_reference.py checks it against the form above).
With ``--outer-lr 1 --outer-momentum 0`` this is local SGD. Every worker needs theta at the
start of the next round, so the all-reduce cannot be hidden, unless Streaming DiLoCo's
``--fragments`` and ``--overlap-steps`` (:mod:`shoal.strategies.streaming`) let each fragment's
exchange travel behind the next steps; the landed fragment is then mixed with the local one,
``alpha * local + (1 - alpha) * global`` (``--mix-alpha``). An epoch's end closes the round
in progress, so the model evaluated and saved has seen every step of the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shoal.core import FlatParams
from shoal.core.dynamo import eager
from shoal.errors import ShoalError
from shoal.strategies.averaging import ModelCopy, average_buffers
from shoal.strategies.communication import Pattern
from shoal.strategies.periodic import PeriodicOptions, PeriodicStrategy
from shoal.strategies.registry import register
from shoal.strategies.streaming import Fragment


@dataclass
class DiLoCoOptions(PeriodicOptions):
    outer_lr: float = field(default=0.7, metadata={"help": "outer (Nesterov SGD) learning rate"})
    outer_momentum: float = field(default=0.3, metadata={
        "help": "outer Nesterov momentum (the paper: 0.9, with inner AdamW); the default keeps "
                "outer-lr / (1 - momentum) = 1 on top of inner momentum"})
    mix_alpha: float = field(default=0.5, metadata={
        "help": "with --overlap-steps: a fragment becomes alpha * local + (1 - alpha) * global "
                "when its outer step lands (Streaming DiLoCo's merge, Algorithm 2; the paper "
                "runs 0.5 with overlap, Figures 8 and 10; torchft's default is 0)"})

    def validate(self) -> None:
        super().validate()
        if not self.outer_lr > 0:
            raise ShoalError(f"--outer-lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ShoalError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0 <= self.mix_alpha <= 1:
            raise ShoalError(f"--mix-alpha must be in [0, 1], got {self.mix_alpha}")


@register
class DiLoCo(PeriodicStrategy):
    """DiLoCo: --tau inner steps, then an outer Nesterov step on the averaged pseudo-gradient;
    Streaming DiLoCo with --fragments and --overlap-steps."""

    name = "diloco"
    Options = DiLoCoOptions

    @classmethod
    def communication(cls, options: DiLoCoOptions, workers: int) -> Pattern:
        """The pseudo-gradients' all-reduce every ``tau`` steps, waited for at once."""
        return cls.outer_pattern(options, workers, "pseudo-gradients")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: DiLoCoOptions | None = None) -> None:
        super().__init__(model, optimizer, comm, options)
        opts: DiLoCoOptions = self.options
        order = self.fragment_order(model.parameters())
        self.flat = FlatParams(order)
        self.theta = ModelCopy(model, order)  # laid out as self.flat
        comm.broadcast(self.theta.vector, src=0, name="global-model")
        self.flat.unpack(self.theta.vector)  # line 3: every worker starts from theta
        self.delta = torch.zeros_like(self.theta.vector)  # the pseudo-gradient, by fragment
        # One outer optimizer a fragment: it steps theta's slice in place; its gradient is
        # the fragment's averaged pseudo-gradient.
        self.outer = []
        for fragment in self.stream(self.flat).fragments:
            param = nn.Parameter(self.theta.vector[fragment.lo:fragment.hi], requires_grad=False)
            param.grad = self.delta[fragment.lo:fragment.hi]
            self.outer.append(eager(torch.optim.SGD)(  # its first step imports no compiler
                [param], lr=opts.outer_lr, momentum=opts.outer_momentum,
                nesterov=opts.outer_momentum > 0))

    @property
    def eval_module(self) -> nn.Module:
        return self.theta.with_buffers_of(self.model)

    @torch.no_grad()
    def launch(self, fragment: Fragment) -> dict:
        """Lines 9-11 for one fragment: its pseudo-gradient, on its way to be averaged."""
        lo, hi = fragment.lo, fragment.hi
        delta = self.delta[lo:hi]
        torch.sub(self.theta.vector[lo:hi], fragment.flat.pack(self.flat.buffer[lo:hi]), out=delta)
        return {"exchange": self.exchanges.send(fragment, delta, "pseudo-gradient")}

    @torch.no_grad()
    def complete(self, fragment: Fragment, kept: dict, moved: bool) -> None:
        """Line 12 (the outer step) for the fragment, and line 3 of its next round: the
        fragment becomes the global one, or (after overlapped steps) the mix of the two."""
        lo, hi = fragment.lo, fragment.hi
        mean = kept["exchange"].wait()
        if mean.data_ptr() != self.delta.data_ptr() + lo * self.delta.element_size():
            self.delta[lo:hi].copy_(mean)
        self.outer[fragment.index].step()
        theta = self.theta.vector[lo:hi]
        if moved and self.options.mix_alpha > 0:
            local = fragment.flat.pack(self.flat.buffer[lo:hi])
            theta = torch.lerp(theta, local, self.options.mix_alpha)
        fragment.flat.unpack(theta)

    def end_epoch(self, epoch: int) -> None:
        self.close_rounds()  # the model evaluated and saved has seen every step
        average_buffers(self.model, self.comm)

    def state_dict(self) -> dict:
        outer = [o.state_dict() for o in self.outer]
        return {**super().state_dict(), "theta": self.theta.vector.clone(),
                "outer": outer[0] if len(outer) == 1 else outer}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.theta.vector.copy_(state["theta"])
        outer = state["outer"] if isinstance(state["outer"], list) else [state["outer"]]
        for mine, saved in zip(self.outer, outer, strict=True):
            mine.load_state_dict(saved)
