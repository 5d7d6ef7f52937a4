"""The reduce operations every front end offers, the even split of rows over ranks, and a
finiteness check that holds on memory another process writes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shoal.errors import ShoalError

#: Reduce ops by name. ``avg`` is a sum divided afterwards by the number of ranks (Gloo has
#: no AVG), or weighted by rows where the caller says so.
REDUCE_OPS: dict[str, dist.ReduceOp] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}


def reduce_op(op: str, where: str = "") -> dist.ReduceOp:
    """The ``torch.distributed`` op named ``op``; an unknown name is a one-line error
    (prefixed by ``where``, e.g. ``"shoal.all_reduce: "``)."""
    try:
        return REDUCE_OPS[op]
    except (KeyError, TypeError):
        raise ShoalError(f"{where}unknown reduce op {op!r}; choose from {', '.join(REDUCE_OPS)}") from None


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` rows in ``parts`` shares, the first ``n % parts`` one row larger (rank order)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def split_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """The contiguous ``[lo, hi)`` ranges of :func:`split_sizes`' shares, in order."""
    ranges, lo = [], 0
    for size in split_sizes(n, parts):
        ranges.append((lo, lo + size))
        lo += size
    return ranges


def values_by_rank(comm: Any, values: Sequence[float]) -> list[list[float]]:
    """Every rank's ``values`` (the same count on each), in rank order, on every rank of
    ``comm`` (a :class:`~shoal.core.comm.Comm`): one all-reduce of a ``world_size x
    len(values)`` table, each rank filling its row (a rank without peers knows its own row
    only: the others are zeros)."""
    table = [0.0] * (comm.world_size * len(values))
    table[comm.rank * len(values):(comm.rank + 1) * len(values)] = values
    summed = comm.reduce_values(table)
    return [summed[r * len(values):(r + 1) * len(values)] for r in range(comm.world_size)]


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite, judged on a copy of each: another
    process may be stepping them in place (Hogwild's shared parameters), and
    ``torch.isfinite`` reads each value more than once, so a value that changes between two
    reads looks non-finite (a live shared vector under another process's ``add_`` did, in
    most checks; its copy never)."""
    return all(bool(torch.isfinite(t.detach().clone()).all()) for t in tensors)
