"""Streaming exchanges of the periodic strategies: fragments, overlap, compressed messages.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication")
splits the model into ``F`` fragments (``--fragments``) exchanged at staggered steps, so the
network carries ``1/F`` of the model at a time, and lets each exchange travel behind the
next ``H`` local steps (``--overlap-steps``) before its result is applied. Within every
period of ``tau`` local steps, fragment ``p = 1..F`` is applied after step ``p tau / F``
(rounded down) and its exchange starts ``H`` steps earlier; ``F = 1, H = 0`` exchanges the
whole model after every ``tau``-th step, as the plain strategies do. That is torchft's
schedule (``DiLoCo(fragment_sync_delay=H)``). The fragments are contiguous runs of whole
parameter tensors of about equal size, in the strategy's parameter order (the paper strides
layers; contiguous runs keep each fragment one slice of the flat vectors).

What is sent goes through :class:`~shoal.core.quantize.CompressedMean` (``--outer-precision``,
``--error-feedback``); the residuals of error feedback are this rank's, one slice per fragment.
An exchange in flight at a checkpoint is waited for (its result does not depend on when) and
its result saved with the step it is due at, so a resumed run applies it at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shoal.core.comm import Comm
from shoal.core.flat import FlatParams
from shoal.core.quantize import Codec, CompressedMean, error_feedback
from shoal.errors import ShoalError


@dataclass
class Fragment:
    """Fragment ``index``: the tensors of ``flat`` (one :class:`FlatParams`), which are
    ``[lo, hi)`` of the strategy's flat vectors."""

    index: int
    lo: int
    hi: int
    flat: FlatParams


def split_fragments(flat: FlatParams, count: int) -> list[Fragment]:
    """``flat``'s tensors in ``count`` contiguous runs of about equal numbers of values
    (``count = 1``: ``flat`` itself); a one-line error when there are fewer tensors."""
    tensors = flat.tensors
    if not 1 <= count <= len(tensors):
        raise ShoalError(f"--fragments must be between 1 and the model's {len(tensors)} "
                         f"parameter tensors, got {count}")
    if count == 1:
        return [Fragment(0, 0, flat.numel, flat)]
    sizes = [t.numel() for t in tensors]
    cuts, total, seen = [0], sum(sizes), 0
    for i, size in enumerate(sizes):
        seen += size
        k = len(cuts)
        if k < count and seen >= k * total / count or len(tensors) - (i + 1) == count - k:
            cuts.append(i + 1)
    cuts = cuts[:count] + [len(tensors)]
    out, lo = [], 0
    for p in range(count):
        part = tensors[cuts[p]:cuts[p + 1]]
        hi = lo + sum(t.numel() for t in part)
        out.append(Fragment(p, lo, hi, FlatParams(part)))
        lo = hi
    return out


class Done:
    """An exchange whose result is known (restored from a checkpoint)."""

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


class Exchanges:
    """One strategy's fragments, their schedule, codec, residuals and exchanges in flight."""

    def __init__(self, flat: FlatParams, options: Any, comm: Comm) -> None:
        self.fragments = split_fragments(flat, options.fragments)
        self.overlap = options.overlap_steps
        self.tau = options.tau if isinstance(options.tau, int) else 0
        self.codec = Codec(options.outer_precision)
        self.comm = comm
        keep = error_feedback(options.outer_precision, options.error_feedback)
        self.residual = torch.zeros(flat.numel, dtype=flat.buffer.dtype,
                                    device=flat.buffer.device) if keep else None
        #: fragment -> (step it started after, step it is due after, what its strategy keeps)
        self.pending: dict[int, tuple[int, int, dict[str, Any]]] = {}
        self.launched = [0] * len(self.fragments)  #: the step each fragment last started after

    @property
    def streaming(self) -> bool:
        """Whether exchanges follow the fragment schedule (not one whole exchange a round)."""
        return len(self.fragments) > 1 or self.overlap > 0

    def starting_after(self, step: int) -> list[Fragment]:
        """The fragments whose exchange starts after local step ``step``."""
        if not self.streaming:
            return []
        count = len(self.fragments)
        return [f for f in self.fragments
                if step % self.tau == ((f.index + 1) * self.tau // count - self.overlap) % self.tau]

    def send(self, fragment: Fragment, x: torch.Tensor, name: str, *,
             mean: bool = True) -> CompressedMean:
        """Start the compressed sum (``mean``: average) of ``x``, ``fragment``'s values."""
        residual = None if self.residual is None else self.residual[fragment.lo:fragment.hi]
        return CompressedMean(self.comm, self.codec, x, name, mean=mean, residual=residual)

    # -- checkpoints: every rank calls these at the same step ------------------------------
    def state_dict(self) -> dict[str, Any]:
        pending = {}
        for p, (start, due, kept) in self.pending.items():
            kept = {k: (v.wait().clone() if k == "exchange" else v) for k, v in kept.items()}
            pending[p] = (start, due, kept)
        return {"residual": None if self.residual is None else self.residual.clone(),
                "pending": pending, "launched": list(self.launched)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.residual is not None and state.get("residual") is not None:
            self.residual.copy_(state["residual"])
        self.launched = list(state.get("launched", self.launched))
        self.pending = {int(p): (start, due, {k: (Done(v) if k == "exchange" else v)
                                             for k, v in kept.items()})
                        for p, (start, due, kept) in state.get("pending", {}).items()}
