"""shoal: data-parallel training on PyTorch with a choice of how workers couple.

Quick use in your own loop (start it with ``shoal run --workers 2 my_loop.py`` or under
``torchrun``; ``examples/own_loop.py`` is a whole one)::

    import shoal
    strategy = shoal.strategy("sync", model, optimizer)     # or "easgd", tau=4, ...
    for epoch in range(epochs):
        for x, y in strategy.batches(dataset, batch_size=16, epoch=epoch):  # this worker's rows
            loss = loss_fn(strategy.module(x), y)
            strategy.backward(loss)
            strategy.step()
            strategy.zero_grad()

Or start the processes from Python, no torchrun (``shoal run script.py`` from a shell)::

    results = shoal.launch(train, cfg, workers=4)    # train(cfg) on 4 ranks; their returns

Or keep a serial program and run chosen functions data-parallel (``docs/parallel.md``)::

    step = shoal.function(grad_step, scatter=["x", "y"], reduce="avg")
    with shoal.fork(2):
        loss = step(model, x, y)

Every public name, with its arguments, returns and errors: ``docs/api.md`` (``make docs``
builds it into ``build/site``).
"""

from shoal.errors import ShoalError, WorkerError
from shoal.version import __version__

# Imported on first use, each from its module: the ``shoal`` command starts the server that
# forks its workers (and imports torch for them) before it imports torch itself.
_HOMES = {"init": "runtime", "launch": "runtime", "shutdown": "runtime", "strategy": "runtime",
          "STRATEGIES": "strategies", "Strategy": "strategies", "get_strategy": "strategies",
          "register": "strategies"}
# The single-controller API (shoal.parallel).
_PARALLEL = ("all_gather", "all_reduce", "broadcast", "close", "fork", "function", "gather", "reduce",
             "replicate", "scatter", "shared")


def __getattr__(name: str) -> object:
    import importlib

    if name in _HOMES:
        return getattr(importlib.import_module(f"shoal.{_HOMES[name]}"), name)
    if name in _PARALLEL or name == "parallel":
        parallel = importlib.import_module("shoal.parallel")
        return parallel if name == "parallel" else getattr(parallel, name)
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")


__all__ = ["STRATEGIES", "ShoalError", "Strategy", "WorkerError", "__version__", "all_gather",
           "all_reduce", "broadcast", "close", "fork", "function", "gather", "get_strategy", "init",
           "launch", "reduce", "register", "replicate", "scatter", "shared", "shutdown", "strategy"]
