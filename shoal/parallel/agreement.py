"""Before a collective moves any data, every rank checks that all ranks make the same call
on tensors of the same number, dtypes and shapes (dimension 0 may differ where ranks'
tensors are concatenated); if not, every rank raises :class:`~shoal.ShoalError` naming the
ranks and shapes, and no rank is left waiting.

The check is a digest of the call each rank makes, compared across ranks: through Gloo (an
all-gather of two integers), or, for a call whose data goes through the host's shared memory
(:mod:`shoal.parallel.hostsums`), through that memory too (so that such a call makes no Gloo
call at all). Only when the digests differ do the ranks exchange their calls in full, for
the message.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.intrahost import HostPath, SharedReducer
from shoal.errors import ShoalError


def _fmt(desc: tuple[Any, ...], cat: bool) -> str:
    parts = [f"{d.replace('torch.', '')}[{'*, ' if cat else ''}{', '.join(map(str, s))}]".replace(", ]", "]")
             for d, s in desc]
    return f"{len(parts)} tensor{'s' * (len(parts) != 1)} " + ", ".join(parts[:6]) + \
        (", ..." if len(parts) > 6 else "")


def agree(name: str, tensors: list[torch.Tensor], world_size: int, cat: bool,
           extra: Any = None) -> list[list[int]] | None:
    """Check that every rank holds matching tensors; for ``cat``, return each rank's dim 0s."""
    desc = tuple((str(t.dtype), tuple(t.shape[1:]) if cat else tuple(t.shape)) for t in tensors)
    crc = zlib.crc32(repr((name, extra, desc)).encode())
    vec = torch.tensor([len(tensors), crc], dtype=torch.int64)
    got = [torch.empty_like(vec) for _ in range(world_size)]
    dist.all_gather(got, vec)
    if any(not torch.equal(g, vec) for g in got):
        descs: list[Any] = [None] * world_size
        dist.all_gather_object(descs, (name, extra, desc))
        ranks = "; ".join(f"rank {r}: {d[0]}({d[1] or ''}) on {_fmt(d[2], cat)}"
                          for r, d in enumerate(descs))
        raise ShoalError(f"shoal.{name}: ranks disagree on the call or on the tensors' dtypes and "
                         f"shapes (nothing was sent): {ranks}")
    if not cat or not tensors:
        return None
    dims = torch.tensor([t.shape[0] if t.dim() else 1 for t in tensors], dtype=torch.int64)
    all_dims = [torch.empty_like(dims) for _ in range(world_size)]
    dist.all_gather(all_dims, dims)
    return [d.tolist() for d in all_dims]


def agree_in_host(host: HostPath, name: str, tensors: list[torch.Tensor], world_size: int,
                  extra: Any = None, cat: bool = False) -> None:
    """:func:`agree` for a call whose data goes through ``host``: each rank adds its
    digest's two 16-bit halves, their squares and its number of tensors to the others' (a sum
    in float64, exact). The sums are those of ``world_size`` equal digests only if every
    rank's is this one's (equality in the Cauchy-Schwarz inequality); otherwise every rank
    sees the same sums and all go on to :func:`agree`, which names the ranks."""
    desc = tuple((str(t.dtype), tuple(t.shape[1:]) if cat else tuple(t.shape)) for t in tensors)
    crc = zlib.crc32(repr((name, extra, desc)).encode())
    lo, hi = crc & 0xFFFF, crc >> 16
    mine = torch.tensor([lo, hi, lo * lo, hi * hi, len(tensors)], dtype=torch.float64)
    total = host.all_reduce(mine.clone(), "sum")
    if not torch.equal(total, mine * world_size):
        agree(name, tensors, world_size, cat, extra)


def rows_in_host(host: HostPath, local: SharedReducer, name: str, tensors: list[torch.Tensor],
                 world_size: int, extra: Any = None) -> list[list[int]]:
    """:func:`agree` with ``cat`` for a call whose data goes through ``local`` (the host's
    memory): the check as :func:`agree_in_host` makes it, then every rank's dim 0s."""
    agree_in_host(host, name, tensors, world_size, extra, cat=True)
    dims = torch.tensor([t.shape[0] if t.dim() else 1 for t in tensors], dtype=torch.int64)
    rows = [torch.empty_like(dims) for _ in range(world_size)]
    local.all_gather(dims, rows)
    return [r.tolist() for r in rows]
