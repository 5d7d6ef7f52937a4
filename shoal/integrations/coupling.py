"""What every framework's coupling shares: the refusals, the strategy stepped after the
loop's own ``optimizer.step()``, the trained model at the end, and every rank's state in
the framework's checkpoint.

:mod:`shoal.integrations.accelerate` and :mod:`shoal.integrations.lightning` adapt
:class:`Coupled` to their framework's hooks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shoal
from shoal.core.comm import Comm
from shoal.errors import ShoalError
from shoal.strategies import get_strategy, make_options
from shoal.strategies.easgd import ElasticAveragingMomentum


class StepTaken:
    """The user's optimizer as the strategy sees it: the loop already called its ``step()``
    (the framework's way), so the strategy's local step does not take it again. All else
    (its groups, their learning rates, its state) is the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self, closure: Any = None) -> None:
        """Nothing: the loop's ``optimizer.step()`` took this step."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def check_strategy(strategy: str, options: dict[str, Any]) -> None:
    """Refuse, in one line, a strategy or option that a coupling cannot run faithfully.

    Args:
        strategy: The strategy's name.
        options: Its options, by field name.

    Raises:
        ShoalError: An unknown strategy or option, or a value out of range; ``elastic``; a
            strategy that needs parameter servers or takes its local step itself
            (``eamsgd``); ``tau="auto"``.
    """
    if "elastic" in options:
        raise ShoalError("--elastic needs shoal to launch and supervise the processes (a lost "
                         "worker's group re-formed): run it with shoal train or shoal run")
    cls = get_strategy(strategy)
    if cls.topology(cls.Options(), 2).servers:
        raise ShoalError(f"strategy {strategy} needs shoal to lay out its processes (parameter "
                         "servers beside the workers): run it with shoal train or shoal run")
    if issubclass(cls, ElasticAveragingMomentum):
        raise ShoalError("eamsgd takes its local step itself (Nesterov momentum in x and v), "
                         "which the loop's optimizer.step() would take twice: use easgd, or "
                         "shoal's own loop")
    make_options(cls, options)  # an unknown option or a value out of range: before joining
    if options.get("tau") is not None and isinstance(options["tau"], str):
        raise ShoalError(f"tau={options['tau']!r} adapts to every step's loss, which a coupling "
                         "does not see: give a number of steps")


class Coupled:
    """A shoal strategy stepped after a framework's ``optimizer.step()``.

    Args:
        name: The strategy (``"sync"``: none, the framework's DDP couples the replicas).
        model: The model the optimizer steps, unwrapped (no DDP).
        optimizer: Its optimizer.
        comm: The job (`shoal.init`, on the framework's process group).
        options: The strategy's options, by field name.
    """

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm, options: dict[str, Any]) -> None:
        self.name, self.steps, self.comm = name, 0, comm
        self.inner, self.optimizer = model, optimizer
        self.strategy = None if name == "sync" else shoal.strategy(
            name, model, StepTaken(optimizer), comm, **options)  # type: ignore[arg-type]

    def step(self) -> None:
        """After ``optimizer.step()``: count the step, and exchange when the strategy's
        schedule says so (EASGD's pull lands here too)."""
        self.steps += 1
        if self.strategy is not None:
            self.strategy.step()

    @torch.no_grad()
    def finish(self) -> None:
        """Close the strategy's round in progress (every exchange in flight applied) and give
        every rank's model the trained one (DiLoCo's global model, EASGD's center). A
        collective."""
        if self.strategy is None:
            return
        self.strategy.end_epoch(self.steps)
        trained = self.strategy.eval_module
        if trained is not self.inner:
            for mine, theirs in zip(self.inner.parameters(), trained.parameters(), strict=True):
                mine.copy_(theirs)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's strategy state, gathered for the one file rank 0 writes: where
        replicas drift (all but ``sync``) each rank's model and optimizer too, which the
        framework saves of rank 0 only. A collective: call it on every rank."""
        if self.strategy is None:
            return {"strategy": self.name, "steps": self.steps}
        own = {"strategy": self.strategy.state_dict(), "model": self.inner.state_dict(),
               "optimizer": self.optimizer.state_dict()}
        ranks: list[Any] = [own]
        if self.comm.world_size > 1:
            ranks = [None] * self.comm.world_size
            with self.comm.track("all_gather", "strategy state"):
                dist.all_gather_object(ranks, own)
        return {"strategy": self.name, "steps": self.steps, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back this rank's part of what :meth:`state_dict` gathered: its model, its
        optimizer and its strategy state.

        Raises:
            ShoalError: The state is another strategy's, or of another number of processes.
        """
        if state.get("strategy") != self.name:
            raise ShoalError(f"the saved coupling state is {state.get('strategy')!r}'s, this "
                             f"coupling's strategy is {self.name!r}")
        self.steps = int(state["steps"])
        if self.strategy is None:
            return
        ranks = state["ranks"]
        if len(ranks) != self.comm.world_size:
            raise ShoalError(f"the saved coupling state is of {len(ranks)} processes, this job "
                             f"has {self.comm.world_size}: resume on {len(ranks)}")
        own = ranks[self.comm.rank]
        self.inner.load_state_dict(own["model"])
        self.optimizer.load_state_dict(own["optimizer"])
        self.strategy.load_state_dict(own["strategy"])
