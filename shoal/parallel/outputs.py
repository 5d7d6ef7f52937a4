"""A parallel function's outputs on one rank: accumulated over its slices, described for the
cross-rank check, reduced to rank 0 and put back together there."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from shoal.core.flat import by_dtype, flatten, unflatten_into
from shoal.core.ops import REDUCE_OPS
from shoal.core.timeline import COMM
from shoal.errors import ShoalError
from shoal.parallel.context import Meter
from shoal.parallel.spec import FunctionSpec


def _as_tensor(leaf: Any, where: str) -> tuple[torch.Tensor, bool]:
    if isinstance(leaf, torch.Tensor):
        return leaf.detach(), False
    if isinstance(leaf, (bool, int, float, np.number, np.bool_)):
        value = leaf.item() if isinstance(leaf, (np.number, np.bool_)) else leaf
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        return torch.tensor(value, dtype=dtype), True
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(leaf), False
    raise ShoalError(f"{where} is a {type(leaf).__name__}; reducible outputs are tensors, numbers "
                     "or lists/tuples/dicts of them (use reduce None to return anything)")


def _fmt(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class Output:
    """One top-level output of one rank, accumulated over its slices."""

    def __init__(self, key: Any, mode: Any) -> None:
        self.key, self.mode = key, mode
        self.value: Any = None  # mode None: the last slice's value
        self.spec: Any = None
        self.leaves: list[Any] = []
        self.numbers: list[bool] = []

    def add(self, value: Any, weight: float, fname: str) -> None:
        if self.mode is None:
            self.value = value
            return
        leaves, spec = tree_flatten(value)
        where = f"output {self.key!r} of {fname}"
        pairs = [_as_tensor(leaf, where) for leaf in leaves]
        if self.spec is None:
            self.spec, self.numbers = spec, [n for _, n in pairs]
            self.leaves = [self._first(t, weight) for t, _ in pairs]
            return
        if spec != self.spec or len(pairs) != len(self.leaves):
            raise ShoalError(f"{where} changes structure between slices")
        for i, (t, _) in enumerate(pairs):
            self.leaves[i] = self._combine(i, t, weight, where)

    def _first(self, t: torch.Tensor, weight: float) -> Any:
        if self.mode == "avg":
            return (t if t.is_floating_point() or t.is_complex() else t.double()) * weight
        if self.mode == "gather":
            return [t.reshape(1) if t.dim() == 0 else t]
        return t.clone()

    def _combine(self, i: int, t: torch.Tensor, weight: float, where: str) -> Any:
        acc = self.leaves[i]
        if self.mode == "gather":
            t = t.reshape(1) if t.dim() == 0 else t
            if t.shape[1:] != acc[0].shape[1:] or t.dtype != acc[0].dtype:
                raise ShoalError(f"{where}: slices return {_fmt(acc[0])} and {_fmt(t)}")
            acc.append(t)
            return acc
        if t.shape != acc.shape:
            raise ShoalError(f"{where}: slices return shapes {list(acc.shape)} and {list(t.shape)}")
        # The accumulator is ours (made by _first): update it in place.
        if self.mode == "avg":
            return acc.add_(t, alpha=weight)
        if self.mode == "sum":
            return acc.add_(t)
        if self.mode == "prod":
            return acc.mul_(t)
        return torch.minimum(acc, t, out=acc) if self.mode == "min" else torch.maximum(acc, t, out=acc)

    def finish_local(self) -> None:
        if self.mode == "gather" and self.spec is not None:
            self.leaves = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in self.leaves]

    def signature(self) -> tuple[Any, ...]:
        shapes = tuple((str(t.dtype), tuple(t.shape[1:]) if self.mode == "gather" else tuple(t.shape))
                       for t in self.leaves)
        return (self.key, self.mode, str(self.spec), shapes)


def describe(sig: Any) -> str:
    """One rank's :meth:`Result.signature` in words, for the error when ranks disagree."""
    if sig is None:
        return "(failed)"
    _, outputs = sig
    parts = []
    for key, mode, _, shapes in outputs:
        dims = ", ".join(f"{d.replace('torch.', '')}[{'*, ' if mode == 'gather' else ''}"
                         f"{', '.join(map(str, s))}]".replace(", ]", "]") for d, s in shapes)
        parts.append(f"output {key!r} ({mode}): {dims}")
    return "; ".join(parts) or "no outputs"


class Result:
    """One rank's outputs of one call."""

    def __init__(self, f: FunctionSpec) -> None:
        self.f = f
        self.kind: Any = None
        self.outputs: list[Output] = []
        self._parts: list[list[torch.Tensor]] = []  # rank 0: every rank's gathered outputs

    def add(self, out: Any, weight: float) -> None:
        if isinstance(out, tuple):
            kind: Any = type(out)
            items = list(enumerate(out))
        elif isinstance(out, dict):
            kind, items = dict, list(out.items())
        else:
            kind, items = "single", [(0, out)]
        if self.kind is None:
            self.kind = kind
            self.outputs = [Output(k, self.f.mode(k)) for k, _ in items]
        elif kind != self.kind or [k for k, _ in items] != [o.key for o in self.outputs]:
            raise ShoalError(f"{self.f.name} returns different structures in different slices")
        for o, (_, value) in zip(self.outputs, items, strict=False):
            o.add(value, weight, self.f.name)

    def reduced(self) -> list[Output]:
        return [o for o in self.outputs if o.mode is not None]

    def signature(self) -> Any:
        for o in self.outputs:
            o.finish_local()
        return (str(self.kind), tuple(o.signature() for o in self.reduced()))

    def gather_dims(self) -> list[int]:
        return [t.shape[0] for o in self.reduced() if o.mode == "gather" for t in o.leaves]

    def communicate(self, rank: int, world_size: int, max_dims: list[int], meter: Meter) -> None:
        """Reduce every output to rank 0 (one collective per mode and dtype, or per gather),
        booked as communication on ``meter``."""
        by_mode: dict[str, list[torch.Tensor]] = {}
        gathered = []
        for o in self.reduced():
            if o.mode == "gather":
                gathered.extend(o.leaves)
            else:
                by_mode.setdefault(o.mode, []).extend(o.leaves)
        with meter.leaf(COMM, "reduce"):
            for mode, tensors in by_mode.items():
                for group in by_dtype(tensors):
                    if len(group) == 1 and group[0].is_contiguous():
                        # The accumulator is ours: reduce in place.
                        self._reduce(group[0], mode, rank, meter)
                        continue
                    flat = flatten(group)
                    self._reduce(flat, mode, rank, meter)
                    if rank == 0:
                        unflatten_into(flat, group)
            for t, rows in zip(gathered, max_dims, strict=False):
                if t.shape[0] < rows:
                    t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
                t = t.contiguous()
                bufs = [torch.empty_like(t) for _ in range(world_size)] if rank == 0 else None
                if rank != 0:
                    meter.count(t.numel() * t.element_size())
                dist.gather(t, bufs, dst=0)
                if bufs is not None:
                    self._parts.append(bufs)

    @staticmethod
    def _reduce(t: torch.Tensor, mode: str, rank: int, meter: Meter) -> None:
        if rank != 0:
            meter.count(t.numel() * t.element_size())
        dist.reduce(t, dst=0, op=REDUCE_OPS[mode])

    def value(self, dims: list[list[int]] | None) -> Any:
        """The combined result on rank 0 (after :meth:`communicate`, or alone)."""
        g = 0
        values = []
        for o in self.outputs:
            if o.mode is None:
                values.append(o.value)
                continue
            leaves = []
            for i, t in enumerate(o.leaves):
                if o.mode == "gather":
                    if dims is not None:
                        t = torch.cat([part[:d[g]] for part, d in zip(self._parts[g], dims, strict=False)])
                    g += 1
                if o.numbers[i] and o.mode != "gather" and t.numel() == 1:
                    leaves.append(t.item())
                else:
                    leaves.append(t)
            values.append(tree_unflatten(leaves, o.spec))
        if self.kind == "single":
            return values[0]
        if self.kind is dict:
            return {o.key: v for o, v in zip(self.outputs, values, strict=False)}
        return self.kind(*values) if hasattr(self.kind, "_fields") else self.kind(values)
