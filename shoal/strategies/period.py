"""The communication period of the periodic strategies: ``--tau N``, or ``--tau auto``.

``--tau auto[:N]`` is AdaComm (Wang & Joshi 2019, "Adaptive communication strategies to
achieve the best error-runtime trade-off in local-update SGD", Section 5): start with a
long period ``tau_0 = N`` (default 16), which saves communication while the loss is high,
and shorten it as the loss falls, which lowers the error floor that local updates leave.
After round ``l`` (the local steps between two exchanges) the next period is

    tau_{l+1} = ceil( tau_0 * sqrt( (eta_0 F_l) / (eta_l F_0) ) ),   clipped to [1, tau_0]

where ``F_l`` is the training loss averaged over every worker's steps of round ``l`` (the
paper's ``F(x)`` at the round's start, here the running mean the workers already compute),
``F_0`` that of the first round, and ``eta`` the learning rate at the round's end (AdaComm's
rule for a decaying rate: the optimal period grows as ``1/sqrt(eta)``). Every worker must
take the same periods, so the losses are summed over workers in one small all-reduce
started at each exchange and read at the next one: a period follows the loss of the round
before the last, and the reduction travels behind a whole round of compute.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shoal.core.comm import Comm, Handle
from shoal.errors import ShoalError
from shoal.schema import flag_name

#: ``--tau auto`` starts from this period.
AUTO_START = 16


def parse_period(text: str) -> int | str:
    """``--tau``'s text: ``8`` -> 8; ``auto`` and ``auto:32`` stay text (checked by
    :func:`first_period`)."""
    try:
        return int(text)
    except ValueError:
        return text


def first_period(tau: int | str) -> int:
    """The period a run starts with: ``tau`` itself, or ``N`` of ``auto[:N]``; a one-line
    error for anything else."""
    if isinstance(tau, str):
        name, colon, start = tau.partition(":")
        value = int(start) if colon and start.strip().isdigit() else (None if colon else AUTO_START)
        if name.strip() != "auto" or value is None or value < 1:
            raise ShoalError(f"{flag_name('tau')} must be a number of steps, auto or auto:N "
                             f"(N >= 1), got {tau!r}")
        return value
    if tau < 1:
        raise ShoalError(f"{flag_name('tau')} must be at least 1, got {tau}")
    return tau


class AdaptivePeriod:
    """AdaComm's period for one worker of a periodic strategy (see the module docstring).

    :meth:`observe` each step's loss (or, with gradient accumulation, each micro-batch's
    share of it), :meth:`step_done` after each step; :meth:`next_period` at each exchange
    returns the period of the round that starts there.
    """

    def __init__(self, start: int, comm: Comm) -> None:
        self.start, self.period, self.comm = start, start, comm
        self.base: tuple[float, float] | None = None  # (F_0, eta_0)
        self._loss: torch.Tensor | float = 0.0  # this round's loss sum (on the loss's device)
        self._steps = 0
        self._pending: tuple[Handle, float] | None = None  # last round's sum in flight, its eta
        self._done: tuple[float, float] | None = None  # a round's (mean loss, eta), settled

    def observe(self, loss: torch.Tensor) -> None:
        self._loss = self._loss + loss.detach().double()  # no sync with a GPU per step

    def step_done(self) -> None:
        self._steps += 1

    def next_period(self, lr: float) -> int:
        """Close this round (its loss sum starts its all-reduce) and return the next period,
        from the round before (whose all-reduce is done by now)."""
        self._settle()
        latest, self._done = self._done, None
        summed = torch.tensor([float(self._loss), self._steps], dtype=torch.float64,
                              device=self.comm.device)
        self._loss, self._steps = 0.0, 0
        self._pending = (self.comm.all_reduce_async(summed, "sum", "period loss"), lr)
        if latest is None:
            return self.period
        loss, eta = latest
        if self.base is None:
            self.base = latest
        f0, eta0 = self.base
        ratio = (eta0 * loss) / (eta * f0) if eta > 0 and f0 > 0 else 1.0
        if math.isfinite(ratio) and ratio > 0:
            self.period = min(self.start, max(1, math.ceil(self.start * math.sqrt(ratio))))
        return self.period

    def _settle(self) -> None:
        if self._pending is None:
            return
        handle, eta = self._pending
        self._pending = None
        total, steps = handle.wait().tolist()
        if steps > 0:
            self._done = (total / steps, eta)

    # -- checkpoints: every rank calls these at the same step ------------------------------
    def state_dict(self) -> dict[str, Any]:
        self._settle()
        return {"period": self.period, "base": self.base, "loss": float(self._loss),
                "steps": self._steps, "done": self._done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.period = int(state["period"])
        self.base = tuple(state["base"]) if state["base"] is not None else None
        self._loss, self._steps = float(state["loss"]), int(state["steps"])
        self._done = tuple(state["done"]) if state["done"] is not None else None
        self._pending = None
