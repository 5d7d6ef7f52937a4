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
communication is all exposed, unless ``--overlap-steps`` lets it land later (each worker then
moves by the average minus what it sent, keeping the steps taken meanwhile). At each
epoch's end the models (and batch-norm statistics) are averaged once more, so the model
evaluated and saved is the consensus.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.core import FlatParams
from shoal.strategies.averaging import average_buffers
from shoal.strategies.communication import Pattern
from shoal.strategies.periodic import PeriodicOptions, PeriodicStrategy
from shoal.strategies.registry import register
from shoal.strategies.streaming import Fragment


@register
class LocalSGD(PeriodicStrategy):
    """Local steps; every --tau steps the models are averaged (one packed all-reduce)."""

    name = "local-sgd"

    @classmethod
    def communication(cls, options: PeriodicOptions, workers: int) -> Pattern:
        """The parameters' all-reduce every ``tau`` steps (its first, for ``--tau auto``),
        waited for at once, in ``--outer-precision``."""
        return cls.outer_pattern(options, workers, "parameters")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: PeriodicOptions | None = None) -> None:
        super().__init__(model, optimizer, comm, options)
        self.flat = FlatParams(self.fragment_order(model.parameters()))
        comm.broadcast(self.flat.pack(), src=0, name="start")  # every worker starts from x_0
        self.flat.unpack()
        self.stream(self.flat)
        # Compressed, the workers send how far they moved from the last average (which
        # every worker holds), not their models.
        self.anchor = None if self.options.outer_precision == "fp32" else self.flat.pack().clone()

    @torch.no_grad()
    def launch(self, fragment: Fragment) -> dict:
        lo, hi = fragment.lo, fragment.hi
        x = fragment.flat.pack(self.flat.buffer[lo:hi])
        kept = {"sent": x.clone()} if self.exchanges.streaming else {}
        if self.anchor is not None:
            x = x - self.anchor[lo:hi]
        elif self.exchanges.streaming:
            x = x.clone()  # reduced in place while the buffer packs the next steps' model
        kept["exchange"] = self.exchanges.send(fragment, x, "average")
        return kept

    @torch.no_grad()
    def complete(self, fragment: Fragment, kept: dict, moved: bool) -> None:
        """The fragment becomes the average; after overlapped steps it moves by the average
        minus what it sent, keeping those steps' progress."""
        lo, hi = fragment.lo, fragment.hi
        average = kept["exchange"].wait()
        if self.anchor is not None:
            average = self.anchor[lo:hi].add_(average)
        if moved:
            x = fragment.flat.pack(self.flat.buffer[lo:hi])
            average = x.add_(average).sub_(kept["sent"])
        fragment.flat.unpack(average)

    def end_epoch(self, epoch: int) -> None:
        self.close_rounds()  # else the last step has just averaged
        average_buffers(self.model, self.comm)

    def state_dict(self) -> dict:
        state = super().state_dict()
        return state if self.anchor is None else {**state, "anchor": self.anchor.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.anchor is not None and "anchor" in state:
            self.anchor.copy_(state["anchor"])
