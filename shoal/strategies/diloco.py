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
start of the next round, so the all-reduce cannot be hidden. An epoch's end closes the round
in progress, so the model evaluated and saved has seen every step of the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shoal.core import FlatParams
from shoal.errors import ShoalError
from shoal.strategies.averaging import ModelCopy, average_buffers
from shoal.strategies.base import PeriodicOptions, PeriodicStrategy
from shoal.strategies.communication import Exchange, Pattern
from shoal.strategies.period import first_period
from shoal.strategies.registry import register


@dataclass
class DiLoCoOptions(PeriodicOptions):
    outer_lr: float = field(default=0.7, metadata={"help": "outer (Nesterov SGD) learning rate"})
    outer_momentum: float = field(default=0.5, metadata={
        "help": "outer Nesterov momentum (the paper: 0.9, with inner AdamW)"})

    def validate(self) -> None:
        super().validate()
        if not self.outer_lr > 0:
            raise ShoalError(f"--outer-lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ShoalError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")


@register
class DiLoCo(PeriodicStrategy):
    """DiLoCo: --tau inner steps, then an outer Nesterov step on the averaged pseudo-gradient."""

    name = "diloco"
    Options = DiLoCoOptions

    @classmethod
    def communication(cls, options: DiLoCoOptions, workers: int) -> Pattern:
        """The pseudo-gradients' all-reduce every ``tau`` steps, waited for at once."""
        return Pattern(Exchange.ALL_REDUCE, "pseudo-gradients", every=first_period(options.tau))

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: DiLoCoOptions | None = None) -> None:
        super().__init__(model, optimizer, comm, options)
        opts: DiLoCoOptions = self.options
        self.flat = FlatParams(model.parameters())
        self.theta = ModelCopy(model)
        comm.broadcast(self.theta.vector, src=0, name="global-model")
        self.flat.unpack(self.theta.vector)  # line 3: every worker starts from theta
        # The outer optimizer steps theta in place; its gradient is the pseudo-gradient.
        self._outer_param = nn.Parameter(self.theta.vector, requires_grad=False)
        self._outer_param.grad = torch.zeros_like(self.theta.vector)
        self.outer = torch.optim.SGD([self._outer_param], lr=opts.outer_lr,
                                     momentum=opts.outer_momentum,
                                     nesterov=opts.outer_momentum > 0)

    @property
    def eval_module(self) -> nn.Module:
        return self.theta.with_buffers_of(self.model)

    @torch.no_grad()
    def exchange(self) -> None:
        """Lines 9-12 (the outer step) and line 3 of the next round."""
        delta = self._outer_param.grad
        torch.sub(self.theta.vector, self.flat.pack(), out=delta)
        self.comm.all_reduce(delta, "avg", "pseudo-gradient")
        self.outer.step()
        self.flat.unpack(self.theta.vector)

    def end_epoch(self, epoch: int) -> None:
        if self.in_round:  # close the round in progress
            self.exchange()
        average_buffers(self.model, self.comm)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "theta": self.theta.vector.clone(),
                "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.theta.vector.copy_(state["theta"])
        self.outer.load_state_dict(state["outer"])
