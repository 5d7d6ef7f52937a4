"""Parameter averaging shared by the low-communication strategies.

Local SGD, elastic averaging and DiLoCo all move whole models, not gradients: each packs
every parameter into one flat buffer (:class:`~shoal.core.flat.FlatParams`) and sends it as a
single message, the trick that cut the EASGD paper's communication most. What they share
lives here, once.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from shoal.core.comm import Comm
from shoal.core.flat import FlatParams


def float_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The module's floating-point buffers (batch-norm running statistics, ...)."""
    return [b for b in module.buffers() if b.is_floating_point()]


@torch.no_grad()
def average_into(flat: FlatParams, comm: Comm, name: str) -> None:
    """Replace ``flat``'s tensors by their average over all ranks (one message)."""
    if not comm.active:
        return
    comm.all_reduce(flat.pack(), op="avg", name=name)
    flat.unpack()


@torch.no_grad()
def average_buffers(module: nn.Module, comm: Comm) -> None:
    """Average ``module``'s floating-point buffers over all ranks, in place.

    Replicas that step on their own keep their own batch-norm statistics; averaging them
    gives the consensus model statistics that describe all of the data.
    """
    buffers = float_buffers(module)
    if buffers and comm.active:
        average_into(FlatParams(buffers), comm, "average-buffers")


class ModelCopy:
    """A frozen copy of a model whose parameters are views into one flat vector.

    The elastic center of EASGD and the global model of DiLoCo are such copies: strategies
    update :attr:`vector` with a handful of tensor operations and one message, and
    :attr:`module` (for evaluating and saving) reflects it without any copying. The vector
    holds the parameters in the order of ``params`` (default ``model.parameters()``), so it
    lines up with a :class:`FlatParams` of the same list.
    """

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter] | None = None) -> None:
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        index = {id(p): i for i, p in enumerate(model.parameters())}
        copies = list(self.module.parameters())
        order = [copies[index[id(p)]] for p in params] if params is not None else copies
        flat = FlatParams(order)
        self.vector = flat.pack()
        with torch.no_grad():
            for param, view in zip(order, flat.views(), strict=True):
                param.data = view

    @torch.no_grad()
    def with_buffers_of(self, model: nn.Module) -> nn.Module:
        """:attr:`module` with ``model``'s floating-point buffers (batch-norm statistics)."""
        for mine, theirs in zip(float_buffers(self.module), float_buffers(model), strict=True):
            mine.copy_(theirs)
        return self.module
