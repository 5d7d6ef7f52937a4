"""The Strategy interface: how workers couple.

A strategy owns everything that crosses between workers during training. The trainer (or
a user's own loop) calls it in a fixed order each step::

    out = strategy.module(x)                  # forward (DDP-wrapped for ``sync``)
    strategy.backward(loss * strategy.loss_weight(n_local, n_global))
    strategy.step()                           # instead of optimizer.step()
    strategy.zero_grad()

and ``strategy.end_epoch()`` after each epoch. :attr:`Strategy.eval_module` is the model to
evaluate and save (the elastic center for EASGD). Options are a dataclass; its fields become
command-line flags (``tau`` becomes ``--tau``), so a new strategy needs nothing but its file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.comm import Comm
from shoal.errors import ShoalError


@dataclasses.dataclass
class NoOptions:
    """A strategy without options."""


@dataclasses.dataclass
class PeriodicOptions:
    """Options of the strategies that exchange models every ``tau`` local steps."""

    tau: int = dataclasses.field(default=4, metadata={"help": "local steps between two exchanges"})
    measure_wait: bool = dataclasses.field(default=False, metadata={
        "help": "book the time spent waiting for the slowest rank as wait, not comm "
                "(one tiny extra message per exchange)"})

    def validate(self) -> None:
        if self.tau < 1:
            raise ShoalError(f"--tau must be at least 1, got {self.tau}")


class Strategy:
    """Base class: plain local SGD steps with no communication at all.

    Subclasses set :attr:`name` (the ``--strategy`` value), :attr:`Options` (a dataclass of
    their settings, fields with ``metadata={"help": ...}``) and override the hooks they need.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: True when every rank holds identical parameters and optimizer state after each step,
    #: so checkpoints keep one copy; False when replicas drift (local SGD, EASGD, ...).
    replicas_in_sync: ClassVar[bool] = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 options: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.comm = comm
        self.options = options if options is not None else self.Options()
        validate = getattr(self.options, "validate", None)
        if validate is not None:
            validate()
        self.steps = 0  # optimizer steps taken through this strategy

    # -- the training step ------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The module to run forward and backward through."""
        return self.model

    @property
    def eval_module(self) -> nn.Module:
        """The model to evaluate, report and save."""
        return self.model

    def loss_weight(self, n_local: int, n_global: int) -> float:
        """Factor applied to this rank's mean loss before backward (1 by default)."""
        return 1.0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        """Update the parameters (and communicate, when this strategy's schedule says so)."""
        self.optimizer.step()
        self.steps += 1

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def end_epoch(self, epoch: int) -> None:
        """Called once after each epoch, on every rank, before evaluation."""

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's strategy state (tensors, numbers, dicts); saved per rank."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))


def option_fields(cls: type[Strategy]) -> list[dataclasses.Field]:
    """The dataclass fields of a strategy's options."""
    if not dataclasses.is_dataclass(cls.Options):
        raise ShoalError(f"strategy {cls.name!r}: Options must be a dataclass")
    return list(dataclasses.fields(cls.Options))


def make_options(cls: type[Strategy], values: dict[str, Any]) -> Any:
    """Build and check ``cls.Options`` from ``values``, naming any option it does not take."""
    known = {f.name for f in option_fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        flags = ", ".join("--" + u.replace("_", "-") for u in unknown)
        takes = ", ".join("--" + k.replace("_", "-") for k in sorted(known)) or "no options"
        raise ShoalError(f"strategy {cls.name} does not take {flags} (it takes {takes})")
    options = cls.Options(**values)
    validate = getattr(options, "validate", None)
    if validate is not None:
        validate()  # here too, so that a bad value is caught before any worker starts
    return options


class PeriodicStrategy(Strategy):
    """Base of the strategies that step alone and :meth:`exchange` every ``tau`` steps."""

    Options: ClassVar[type] = PeriodicOptions
    replicas_in_sync: ClassVar[bool] = False

    def step(self) -> None:
        super().step()
        if self.steps % self.options.tau == 0:
            if self.options.measure_wait:
                self.comm.barrier()  # a straggler's lead is booked as wait, not as transfer
            self.exchange()

    def exchange(self) -> None:
        """Communicate: called after every ``tau``-th local step."""
        raise NotImplementedError
