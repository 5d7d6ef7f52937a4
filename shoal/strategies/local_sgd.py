"""Local SGD (periodic model averaging): step alone, average the models every ``tau`` steps.

Stich (2019), "Local SGD converges fast and simply", equation (2); Lin, Stich, Patel & Jaggi
(2020) with ``H = tau`` local steps. For worker ``k`` and the set ``I`` of averaging steps
(here the multiples of ``tau``)::

    x^k_{t+1} = x^k_t - eta g^k_t                               if t+1 is not in I
    x^k_{t+1} = (1/K) sum_k (x^k_t - eta g^k_t)                 if t+1 is in I

:meth:`LocalSGD.exchange` is the second line: after every ``tau``-th local step all
parameters are packed into one buffer and averaged in a single all-reduce. With ``tau = 1``
and plain SGD this is exactly synchronous gradient averaging; larger ``tau`` sends ``tau``
times less. The local step is the optimizer you configure (``eta g`` above is plain SGD's);
its state (momentum, Adam moments) stays local, as in Lin et al. (2020) and
torch.distributed's ``PeriodicModelAverager``.

The average is needed by the very next step, so there is nothing to hide it behind: its
communication is all exposed. At each epoch's end the models (and batch-norm statistics)
are averaged once more, so the model evaluated and saved is the consensus.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.core import FlatParams
from shoal.strategies.averaging import average_buffers, average_into
from shoal.strategies.base import PeriodicOptions, PeriodicStrategy
from shoal.strategies.communication import Exchange, Pattern
from shoal.strategies.period import first_period
from shoal.strategies.registry import register


@register
class LocalSGD(PeriodicStrategy):
    """Local steps; every --tau steps the models are averaged (one packed all-reduce)."""

    name = "local-sgd"

    @classmethod
    def communication(cls, options: PeriodicOptions, workers: int) -> Pattern:
        """The parameters' all-reduce every ``tau`` steps (its first, for ``--tau auto``),
        waited for at once."""
        return Pattern(Exchange.ALL_REDUCE, "parameters", every=first_period(options.tau))

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: PeriodicOptions | None = None) -> None:
        super().__init__(model, optimizer, comm, options)
        self.flat = FlatParams(model.parameters())
        comm.broadcast(self.flat.pack(), src=0, name="start")  # every worker starts from x_0
        self.flat.unpack()

    def exchange(self) -> None:
        average_into(self.flat, self.comm, "average")

    def end_epoch(self, epoch: int) -> None:
        if self.in_round:  # else the last step has just averaged
            self.exchange()
        average_buffers(self.model, self.comm)
