"""All of a model's parameters as one flat buffer: one message per exchange, not one per layer.

The EASGD work on HPC clusters gets much of its speed-up from packing every layer into a
single message; :class:`FlatParams` gives strategies that packing once.
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

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

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

    def zeros_like(self) -> torch.Tensor:
        return torch.zeros_like(self.buffer)
