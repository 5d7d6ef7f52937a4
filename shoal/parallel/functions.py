"""Parallel functions: ``shoal.function(fn, scatter=..., broadcast=..., reduce=...)``.

One call runs in three steps, the same on the controller (rank 0) and on every worker:

1. *Arguments.* The controller sends one small command per worker (function id, row count,
   slices, the ``batch`` indices, and the pickled plain arguments only when they changed
   since the last call). Scatter tensors go out with one ``dist.scatter`` each, broadcast
   tensors with one ``dist.broadcast``; :class:`~shoal.parallel.arrays.SharedArray` arguments are
   already on every worker and cost nothing.
2. *Compute.* Each rank runs ``fn`` on its share, in ``num_slices`` pieces, and accumulates
   the outputs (``avg`` weighted by rows, so uneven shares and slices give the serial answer).
3. *Combine.* Every worker reports ok/error and the shapes of its outputs; only when all
   agree does the controller let the reductions run (one ``dist.reduce`` per mode and dtype,
   one ``dist.gather`` per gathered output).

The steps live in :mod:`~shoal.parallel.call` (any rank), :mod:`~shoal.parallel.outputs`
(accumulation and reductions) and :mod:`~shoal.parallel.controller` (rank 0's side).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shoal.parallel.controller import controller_call
from shoal.parallel.spec import FunctionSpec


class Function(FunctionSpec):
    """A function whose calls run on every worker; see :func:`function`."""

    def __call__(self, *args: Any, num_slices: int = 1, batch: Any = None, **kwargs: Any) -> Any:
        return controller_call(self, args, kwargs, num_slices, batch)


def function(fn: Callable[..., Any] | None = None, *, scatter: Sequence[str] = (),
             broadcast: Sequence[str] = (),
             reduce: str | None | Sequence[str | None] | Mapping[Any, str | None] = "avg",
             name: str | None = None) -> Any:
    """Make ``fn`` a parallel function (also usable as ``@shoal.function(scatter=[...])``).

    Calling it splits the ``scatter`` arguments along dimension 0 across the session's
    processes, sends the ``broadcast`` ones whole, passes other arguments as they are
    (modules and optimizers by reference to each worker's replica), runs ``fn`` everywhere
    and combines its outputs. Outputs may be tensors, numbers, or lists, tuples and dicts of
    them. A call takes two options of its own: ``num_slices=k`` runs each share in ``k``
    pieces and accumulates before the one reduction; ``batch=indices`` first selects those
    rows of every scatter argument. Without a session (no `shoal.fork`) a call runs
    serially.

    Args:
        fn: The function; ``None`` when used as a decorator with options.
        scatter: Names of ``fn``'s parameters to split across processes (tensors, NumPy
            arrays or `shoal.shared` arrays).
        broadcast: Names of ``fn``'s parameters to send whole to every process.
        reduce: How to combine the outputs: one mode for every output, a sequence (one per
            element of a returned tuple) or a dict (by tuple index or dict key; the rest
            ``avg``). Modes: ``avg`` (weighted by rows), ``sum``, ``prod``, ``min``,
            ``max``, ``gather`` (concatenated in rank order along dimension 0) and ``None``
            (rank 0's value).
        name: The name errors and traces give it; default ``fn``'s.

    Returns:
        The parallel function (a `shoal.parallel.Function`), or, without ``fn``, a decorator
            that makes one.

    Raises:
        ShoalError: ``fn`` is not callable, a name in ``scatter`` or ``broadcast`` is not a
            named parameter of ``fn`` (or is in both), a parameter clashes with a call
            option, or a mode is unknown.
    """
    if fn is None:
        return lambda f: Function(f, scatter, broadcast, reduce, name)
    return Function(fn, scatter, broadcast, reduce, name)
