"""The center as server 0's coordinator reads it (:class:`Center`): the whole flat vector,
its own shard and the other servers' (pulled), and the model the run evaluates from it."""

from __future__ import annotations

import torch

from shoal.core.flat import FlatParams
from shoal.ps import ServerClient, ShardServer


class Center:
    """The center of ``model`` (packed as ``flat``), held by the servers in ``ranges`` (each
    one's ``[lo, hi)`` of the flat vector, server 0's first); ``client``: server 0's end of
    the other servers, ``None`` with one server."""

    def __init__(self, flat: FlatParams, model: torch.nn.Module, ranges: list[tuple[int, int]],
                 client: ServerClient | None) -> None:
        self.flat, self.model, self.ranges, self.client = flat, model, ranges, client

    def vector(self, shard: ShardServer) -> torch.Tensor:
        """The whole flat center: server 0's ``shard`` and the others' (pulled)."""
        full = torch.empty(self.ranges[-1][1], dtype=torch.float32)
        lo, hi = self.ranges[0]
        full[lo:hi] = shard.snapshot()[: hi - lo]
        if self.client is not None:
            self.client.pull(full)
        return full

    def load(self, full: torch.Tensor) -> None:
        """Put the flat center ``full`` into the model's parameters."""
        self.flat.unpack(full.to(self.flat.tensors[0].dtype))

    @torch.no_grad()
    def model_with(self, shard: ShardServer, buffers: list[dict[str, torch.Tensor]]
                   ) -> torch.nn.Module:
        """The model the run evaluates: the center, with the mean of the workers' ``buffers``
        (the first of those that are not floating point)."""
        self.load(self.vector(shard))
        for name, buf in self.model.named_buffers():
            values = [b[name] for b in buffers if name in b]
            if values:
                buf.copy_(torch.stack(values).float().mean(0) if buf.is_floating_point()
                          else values[0])
        return self.model


__all__ = ["Center"]
