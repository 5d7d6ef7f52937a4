"""Many tensors as one flat buffer: one message per collective, not one per tensor.

The EASGD work on HPC clusters gets much of its speed-up from packing every layer into a
single message. :class:`FlatParams` keeps a fixed list (a model's parameters) packed into a
buffer of its own; :func:`by_dtype`, :func:`flatten` and :func:`unflatten_into` pack any
list of tensors for one collective per dtype (parallel functions and collectives).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class FlatParams:
    """A fixed list of tensors viewed as one contiguous 1-D buffer.

    ``pack()`` copies the tensors into :attr:`buffer`; ``unpack()`` copies the buffer back.
    Tensors must share dtype and device (true of a model's parameters in practice).
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tensors = [t for t in tensors]
        if not self.tensors:
            raise ValueError("FlatParams needs at least one tensor")
        dtypes = {t.dtype for t in self.tensors}
        if len(dtypes) != 1:
            raise ValueError(f"FlatParams needs tensors of one dtype, got {sorted(map(str, dtypes))}")
        self.numel = sum(t.numel() for t in self.tensors)
        self.buffer = torch.empty(self.numel, dtype=self.tensors[0].dtype, device=self.tensors[0].device)

    def views(self, buffer: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Views into ``buffer`` (default :attr:`buffer`) shaped like the tensors."""
        buf = self.buffer if buffer is None else buffer
        out, offset = [], 0
        for t in self.tensors:
            out.append(buf[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return out

    @torch.no_grad()
    def pack(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the tensors into ``buffer`` (default :attr:`buffer`) and return it."""
        buf = self.buffer if buffer is None else buffer
        for view, t in zip(self.views(buf), self.tensors, strict=False):
            view.copy_(t)
        return buf

    @torch.no_grad()
    def unpack(self, buffer: torch.Tensor | None = None) -> None:
        """Copy ``buffer`` (default :attr:`buffer`) back into the tensors."""
        for t, view in zip(self.tensors, self.views(buffer), strict=False):
            t.copy_(view)


def by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by (dtype, device), in first-seen order: one flat buffer each."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A new 1-D tensor holding ``tensors`` one after the other (one dtype and device)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` back into ``tensors`` (the inverse of :func:`flatten`)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
