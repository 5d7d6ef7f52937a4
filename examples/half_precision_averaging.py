"""A complete strategy in one file: local SGD that sends its averages in bfloat16.

Every ``tau`` steps each worker sends how far it moved since the last average, rounded to
bfloat16 (half the bytes of local SGD), and keeps the rounding error to add to the next
message (error feedback), so no update is ever lost, only delayed. Try it::

    shoal train --strategy examples/half_precision_averaging.py:HalfPrecisionAveraging \\
        --workers 2 --tau 4

Walked through in docs/write-a-strategy.md; tests/test_write_a_strategy.py runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal import Strategy
from shoal.core import FlatParams
from shoal.errors import ShoalError
from shoal.strategies import Exchange, Pattern


@dataclass
class Options:
    tau: int = field(default=4, metadata={"help": "local steps between two averagings"})

    def validate(self) -> None:
        if self.tau < 1:
            raise ShoalError(f"--tau must be at least 1, got {self.tau}")


class HalfPrecisionAveraging(Strategy):
    """Local SGD whose periodic averages travel in bfloat16, with error feedback."""

    name = "half-precision-averaging"
    Options = Options
    replicas_in_sync = False  # workers differ between averages: checkpoint each one

    @classmethod
    def communication(cls, options: Options, workers: int) -> Pattern:
        """For shoal plan's cost model: half the model's bytes, all-reduced every tau steps."""
        return Pattern(Exchange.ALL_REDUCE, "bfloat16 moves", every=options.tau, size=0.5)

    def __init__(self, model, optimizer, comm, options=None) -> None:  # noqa: ANN001
        super().__init__(model, optimizer, comm, options)
        self.flat = FlatParams(model.parameters())
        self.anchor = self.flat.pack().clone()  # where every worker stood at the last average
        self.error = torch.zeros_like(self.anchor)  # what rounding has not sent yet

    @torch.no_grad()
    def step(self) -> None:
        super().step()  # the local optimizer step
        if self.steps % self.options.tau:
            return
        moved = self.flat.pack() - self.anchor + self.error
        message = moved.to(torch.bfloat16)
        self.error = moved - message.float()
        self.comm.all_reduce(message, op="avg", name="average-bf16")
        self.anchor += message.float()
        self.flat.unpack(self.anchor)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "anchor": self.anchor, "error": self.error}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.anchor, self.error = state["anchor"].clone(), state["error"].clone()
