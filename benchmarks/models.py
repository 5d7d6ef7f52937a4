"""Models the benchmarks train that are not in shoal's zoo (``--model benchmarks/models.py:NAME``)."""

from __future__ import annotations

from torch import nn

from shoal.models.small import MLP


def mlp_1024x2(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """784-1024-1024-10 on MNIST-sized inputs: 1.9M parameters and little compute per
    parameter, so gradient communication dominates (a communication-bound model)."""
    return MLP(input_shape, num_classes, width=1024, depth=2)
