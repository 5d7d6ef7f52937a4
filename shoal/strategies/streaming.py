"""Streaming exchanges of the periodic strategies: fragments, overlap, compressed messages.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication")
splits the model into ``F`` fragments (``--fragments``) exchanged at staggered steps, so the
network carries ``1/F`` of the model at a time, and lets each exchange travel behind the
next ``H`` local steps (``--overlap-steps``) before its result is applied. Within every
period of ``tau`` local steps, fragment ``p = 1..F`` is applied after step ``p tau / F``
(rounded down) and its exchange starts ``H`` steps earlier; ``F = 1, H = 0`` exchanges the
whole model after every ``tau``-th step, as the plain strategies do. That is torchft's
schedule (``DiLoCo(fragment_sync_delay=H)``). ``--fragment-pattern`` says which tensors
form a fragment, the paper's two patterns (its Figure 2): ``sequential``, contiguous runs of
whole parameter tensors of about equal size in the strategy's parameter order, or
``strided``, the model's layers (a module's own tensors: a Linear's weight and bias) dealt
round robin, fragment ``p`` holding layers ``p, p + F, p + 2F, ...``. Either way a fragment is
one slice of the strategy's flat vectors: a strided strategy lays its vectors out fragment by
fragment (:func:`fragment_order`).

What is sent goes through :class:`~shoal.core.quantize.CompressedMean` (``--outer-precision``,
``--error-feedback``); the residuals of error feedback are this rank's, one slice per fragment.
An exchange in flight at a checkpoint is waited for (its result does not depend on when) and
its result saved with the step it is due at, so a resumed run applies it at the same step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.core.comm import Comm
from shoal.core.flat import FlatParams
from shoal.core.quantize import Codec, CompressedMean, error_feedback
from shoal.errors import ShoalError

#: ``--fragment-pattern``: which tensors form a fragment.
PATTERNS = ("sequential", "strided")


@dataclass
class Fragment:
    """Fragment ``index``: the tensors of ``flat`` (one :class:`FlatParams`), which are
    ``[lo, hi)`` of the strategy's flat vectors."""

    index: int
    lo: int
    hi: int
    flat: FlatParams


def layers_of(model: nn.Module, tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's layer: the place, among the modules of ``model`` holding some of
    ``tensors`` themselves (not through a child), of the first module that holds it, in the
    model's module order (a tied tensor belongs to its first holder)."""
    holder: dict[int, int] = {}
    for i, module in enumerate(model.modules()):
        for p in module.parameters(recurse=False):
            holder.setdefault(id(p), i)
    missing = [i for i, t in enumerate(tensors) if id(t) not in holder]
    if missing:
        raise ValueError(f"tensor {missing[0]} is not a parameter of the model")
    place = {m: k for k, m in enumerate(sorted({holder[id(t)] for t in tensors}))}
    return [place[holder[id(t)]] for t in tensors]


def sequential_cuts(sizes: list[int], count: int) -> list[int]:
    """Where ``count`` contiguous runs of tensors of about equal numbers of values start (of
    tensors of ``sizes`` values), and the number of tensors at the end."""
    cuts, total, seen = [0], sum(sizes), 0
    for i, size in enumerate(sizes):
        seen += size
        k = len(cuts)
        if k < count and seen >= k * total / count or len(sizes) - (i + 1) == count - k:
            cuts.append(i + 1)
    return cuts[:count] + [len(sizes)]


def fragment_ids(model: nn.Module, tensors: Sequence[torch.Tensor], count: int,
                 pattern: str) -> list[int]:
    """The fragment of each of ``tensors`` (the strategy's parameters, in its order) in
    ``count`` fragments of ``pattern``; a one-line error when there are too few tensors
    (sequential) or layers (strided)."""
    if pattern == "strided":
        layers = layers_of(model, tensors)
        if not 1 <= count <= max(layers) + 1:
            raise ShoalError(f"--fragments must be between 1 and the model's {max(layers) + 1} "
                             f"layers (--fragment-pattern strided), got {count}")
        return [layer % count for layer in layers]
    if not 1 <= count <= len(tensors):
        raise ShoalError(f"--fragments must be between 1 and the model's {len(tensors)} "
                         f"parameter tensors, got {count}")
    cuts = sequential_cuts([t.numel() for t in tensors], count)
    return [p for p in range(count) for _ in range(cuts[p], cuts[p + 1])]


def fragment_order(model: nn.Module, params: Iterable[torch.Tensor], count: int,
                   pattern: str) -> list[torch.Tensor]:
    """``params`` laid out fragment by fragment (each fragment's in their given order), so
    that each fragment is one slice of a flat vector of them: the given order when
    sequential."""
    params = list(params)
    ids = fragment_ids(model, params, count, pattern)
    return [params[i] for i in sorted(range(len(params)), key=ids.__getitem__)]


def split_fragments(flat: FlatParams, ids: list[int]) -> list[Fragment]:
    """``flat``'s tensors as fragments, tensor ``i`` in fragment ``ids[i]`` (one fragment:
    ``flat`` itself); the fragments must be laid out one after the other."""
    if max(ids) == 0:
        return [Fragment(0, 0, flat.numel, flat)]
    if ids != sorted(ids):
        raise ShoalError("the strategy's flat parameters are not laid out fragment by fragment "
                         "(make them in PeriodicStrategy.fragment_order)")
    out, lo = [], 0
    for p in range(max(ids) + 1):
        part = [t for t, i in zip(flat.tensors, ids, strict=True) if i == p]
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

    def __init__(self, flat: FlatParams, options: Any, comm: Comm, model: nn.Module) -> None:
        self.fragments = split_fragments(flat, fragment_ids(
            model, flat.tensors, options.fragments, options.fragment_pattern))
        #: how the fragments were cut (one fragment: the whole model either way)
        self.pattern = options.fragment_pattern if len(self.fragments) > 1 else "sequential"
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
                "pending": pending, "launched": list(self.launched), "pattern": self.pattern}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("pattern", "sequential")  # the only pattern before there were two
        if saved != self.pattern:
            raise ShoalError(f"the saved state's fragments are {saved}, this strategy's "
                             f"{self.pattern}: resume with --fragment-pattern {saved}")
        if self.residual is not None and state.get("residual") is not None:
            self.residual.copy_(state["residual"])
        self.launched = list(state.get("launched", self.launched))
        self.pending = {int(p): (start, due, {k: (Done(v) if k == "exchange" else v)
                                             for k, v in kept.items()})
                        for p, (start, due, kept) in state.get("pending", {}).items()}
