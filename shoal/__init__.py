"""shoal: data-parallel training on PyTorch with a choice of how workers couple.

Quick use in your own loop (run it under ``torchrun``)::

    import shoal
    strategy = shoal.strategy("sync", model, optimizer)
    for x, y in my_shard:
        loss = loss_fn(strategy.module(x), y)
        strategy.backward(loss)
        strategy.step()
        strategy.zero_grad()
"""

__version__ = "0.1.0"

from shoal.errors import ShoalError, WorkerError  # noqa: E402
from shoal.runtime import init, shutdown  # noqa: E402
from shoal.strategies import STRATEGIES, Strategy, register, strategy  # noqa: E402

__all__ = ["STRATEGIES", "ShoalError", "Strategy", "WorkerError", "__version__", "init",
           "register", "shutdown", "strategy"]
