"""Single-controller parallel functions (the Synkhronos model) on PyTorch.

Write a serial program; run chosen functions data-parallel on every process::

    import shoal

    def grad_step(model, opt, x, y, n):           # runs on every process with its rows
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").div(n).backward()
        shoal.all_reduce([p.grad for p in model.parameters()], op="sum")
        opt.step()                                 # every replica takes the same step

    if __name__ == "__main__":
        step = shoal.function(grad_step, scatter=["x", "y"], reduce=None)
        x, y = shoal.shared(x_train), shoal.shared(y_train)   # placed once in shared memory
        with shoal.fork(2):                        # this process is rank 0 and computes too
            for idx in batches:
                step(model, opt, x, y, len(idx), batch=idx)

See ``docs/parallel.md`` for the semantics and the limits.
"""

from shoal.parallel.arrays import SharedArray, shared
from shoal.parallel.collectives import all_gather, all_reduce, broadcast, gather, reduce, scatter
from shoal.parallel.functions import Function, function
from shoal.parallel.protocol import RemoteTraceback
from shoal.parallel.session import ParallelSession, active, close, current
from shoal.parallel.spec import MODES
from shoal.parallel.start import fork


def replicate(*objects: object) -> None:
    """Send ``objects`` to every worker now, by value; afterwards they are passed by
    reference to each worker's replica.

    Modules, optimizers and `shoal.shared` arrays are replicated automatically the first
    time a call needs them; replicate a module before its optimizer. Without an open
    session this does nothing.

    Args:
        *objects: Modules, optimizers, anything picklable.

    Raises:
        ShoalError: The current session is broken (a `shoal.WorkerError` naming the worker
            whose failure broke it).
    """
    session = active()  # raises while a broken session is current
    if session is not None and session.world_size > 1:
        for obj in objects:
            session.registry.register(obj)


__all__ = ["MODES", "SharedArray", "Function", "RemoteTraceback", "ParallelSession", "all_gather",
           "all_reduce", "broadcast", "close", "current", "fork", "function", "gather", "reduce",
           "replicate", "scatter", "shared"]
