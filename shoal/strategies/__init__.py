"""Coupling algorithms, one file each, registered by name.

``strategy(name, model, optimizer, **options)`` makes any of them usable in a hand-written
training loop; ``shoal train --strategy name`` uses the same classes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.core.comm import Comm
from shoal.strategies import diloco, easgd, local_sgd, sync  # noqa: F401 - importing registers
from shoal.strategies.base import (
    PeriodicOptions,
    PeriodicStrategy,
    Strategy,
    make_options,
    option_fields,
)
from shoal.strategies.registry import STRATEGIES, get_strategy, register


def strategy(name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
             comm: Comm | None = None, **options: Any) -> Strategy:
    """Make ``model`` and ``optimizer`` train data-parallel with the strategy ``name``.

    Without ``comm`` the process joins the job its launcher describes (torchrun, Slurm,
    mpirun: see :func:`shoal.init`), or runs alone. Options are the strategy's (``tau=4``).
    """
    from shoal.runtime import init

    cls = get_strategy(name)
    comm = comm if comm is not None else init()
    return cls(model, optimizer, comm, make_options(cls, options))


__all__ = ["STRATEGIES", "PeriodicOptions", "PeriodicStrategy", "Strategy", "get_strategy",
           "make_options", "option_fields", "register", "strategy"]
