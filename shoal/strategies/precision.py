"""What happens to a step's gradients between backward and the update, for any strategy.

Mixed precision (``--precision bf16-mixed`` or ``16-mixed``) autocasts the forward pass and
the loss; the parameters, their gradients, the optimizer's state and every message a
strategy sends stay float32, so the averaging strategies average float32 master weights.
float16's narrow range needs a :class:`torch.amp.GradScaler`: the loss is multiplied by a
large scale before backward, the gradients are divided by it before the update, and a step
whose gradients overflowed (inf or nan) is skipped while the scale shrinks. With ``sync`` the
gradients are all-reduced before that check, so every rank sees the same overflow and skips
the same steps; with the strategies whose replicas step on their own, each rank checks the
gradient it applies itself (no extra message per step).

A skipped step leaves every gradient ``None``: a ``torch.optim`` optimizer then moves no
parameter (no momentum, no weight decay, Adam's step count unchanged). The strategies that
apply the gradient themselves (``eamsgd``, the asynchronous family, ``groups``) read a
missing gradient as zero, so their momentum and weight decay still move on such a step.

In a loop of your own (``shoal train`` does the same)::

    amp = MixedPrecision("16-mixed", comm.device)
    strategy.scaler = amp.scaler                 # backward scales the loss (16-mixed)
    for x, y in strategy.batches(data.train, batch_size=4 * 16, epoch=epoch):
        pieces = list(micro_batches(len(x), 4))  # --accumulate 4
        for i, (lo, hi) in enumerate(pieces):
            with strategy.no_sync(i < len(pieces) - 1):   # only the last one communicates
                with amp.autocast():
                    loss = loss_fn(strategy.module(x[lo:hi]), y[lo:hi])
                strategy.backward(loss * (hi - lo) / len(x))
        if amp.unscale(optimizer):               # False: an overflow; the step is skipped
            clip_gradients(model, 1.0)           # --clip-grad-norm 1
        strategy.step()
        amp.update()
        strategy.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shoal.errors import ShoalError

#: ``--precision`` values and the dtype each autocasts to (``None``: float32, no autocast).
DTYPES: dict[str, torch.dtype | None] = {"32": None, "bf16-mixed": torch.bfloat16,
                                         "16-mixed": torch.float16}


class MixedPrecision:
    """Autocast and (float16) gradient scaling of one worker's training steps."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision not in DTYPES:
            raise ShoalError(f"--precision must be one of {', '.join(DTYPES)}, got {precision!r}")
        self.precision, self.dtype, self.device_type = precision, DTYPES[precision], device.type
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        self.skipped = 0  #: steps skipped because their gradients overflowed

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Where the forward pass and the loss run (nothing changes at ``32``)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @torch.no_grad()
    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients by the scale; whether they are finite. When they are not,
        the step is to be skipped: every gradient is set to ``None``."""
        if self.scaler is None:
            return True
        self.scaler.unscale_(optimizer)
        found = self.scaler._found_inf_per_device(optimizer)  # what unscale_ just checked
        if not any(v.item() for v in found.values()):
            return True
        self.skipped += 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        return False

    def update(self) -> None:
        """After the step: grow the scale, or shrink it after an overflow."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Put back what :meth:`state_dict` saved; a checkpoint without a scaler's state (it
        was written at another precision) leaves the scaler fresh."""
        if not state:
            return
        self.skipped = int(state.get("skipped", 0))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale ``model``'s gradients so that their total (2-)norm is at most ``max_norm``;
    returns the norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None], max_norm)


def micro_batches(n: int, parts: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of ``parts`` contiguous pieces of ``n`` rows (gradient accumulation),
    as even as possible; none empty, so fewer than ``parts`` when ``n < parts``."""
    base, extra = divmod(n, parts)
    start = 0
    for i in range(min(parts, n)):
        end = start + base + (1 if i < extra else 0)
        yield start, end
        start = end
