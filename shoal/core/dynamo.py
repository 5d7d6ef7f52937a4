"""Keep ``torch._dynamo`` (torch's compiler front end) unimported while nothing compiles.

Importing it costs about 1.8 s of CPU, and torch reaches for it where it then does nothing:
optimizers' methods and DDP's forward are wrapped in ``torch._disable_dynamo``, which
imports it at the first call to build their "not traced" versions, and DDP's constructor
reads its ``optimize_ddp`` setting. Every worker of a ``sync`` job, every parameter server
and every launcher checking an optimizer used to pay it (and the server that forks the
workers imported it in advance for them). Here those versions are stand-ins, the functions
themselves, until ``torch._dynamo`` is imported (``--compile``, a user's ``torch.compile``);
from the first call after that, torch's own. A torch whose wrappers are made otherwise is
left as it is.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch


def _wrapped_by_disable(method: Any, wrapper: types.CodeType) -> Any:
    """The ``torch._disable_dynamo`` wrapper under ``method`` (through ``__wrapped__``: a
    context manager's), or ``None``."""
    while method is not None and getattr(method, "__code__", None) is not wrapper:
        method = getattr(method, "__wrapped__", None)
    return method if method is not None and method.__closure__ is not None else None


def defer_disable(cls: type) -> None:
    """Fill the "not traced" cache of each of ``cls``'s methods that torch wraps in
    ``torch._disable_dynamo`` with a stand-in: the method as it is while ``torch._dynamo``
    is not imported, torch's own version from the first call after it is."""
    try:
        from torch._compile import _disable_dynamo
    except ImportError:  # another torch: left as it is
        return
    wrapper = _disable_dynamo(len).__code__
    for method in vars(cls).values():
        found = _wrapped_by_disable(method, wrapper)
        if found is None:
            continue
        cells = dict(zip(found.__code__.co_freevars,
                         (c.cell_contents for c in found.__closure__), strict=True))
        fn, recursive = cells.get("fn"), cells.get("recursive", True)
        if fn is None or getattr(fn, "__dynamo_disable", None) is not None:
            continue

        def stand_in(*args: object, _fn: Any = fn, _recursive: bool = recursive,
                     **kwargs: object) -> object:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None:  # nothing compiles: torch's version would call it as is
                return _fn(*args, **kwargs)
            real = dynamo.disable(_fn, _recursive, wrapping=False)
            setattr(_fn, "__dynamo_disable", real)
            return real(*args, **kwargs)

        setattr(fn, "__dynamo_disable", stand_in)


@contextlib.contextmanager
def ddp_settings() -> Iterator[None]:
    """While DDP's constructor runs: where ``torch._dynamo`` is not imported (so none of its
    settings was changed), ``torch._dynamo.utils.get_optimize_ddp_mode()`` answers its
    default (``optimize_ddp = True``: ``"ddp_optimizer"``) without importing it."""
    if "torch._dynamo" in sys.modules or "_dynamo" in vars(torch):
        yield
        return
    stand_in = types.SimpleNamespace(
        utils=types.SimpleNamespace(get_optimize_ddp_mode=lambda: "ddp_optimizer"))
    torch._dynamo = stand_in  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if vars(torch).get("_dynamo") is stand_in:
            del torch._dynamo  # type: ignore[attr-defined]



_EAGER: dict[type, type] = {}


def eager(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` (a subclass of the same name) whose construction and ``step`` spare a process
    the import of ``torch._dynamo`` (about 1 s of CPU, at every worker's first step) while
    nothing compiles (:func:`defer_disable` of :class:`torch.optim.Optimizer`, done here).

    torch wraps the step of its optimizers (``_use_grad_for_differentiable``) in a function
    that imports ``torch._dynamo`` to call ``graph_break()`` around it, which does nothing
    outside compilation; the wrapper otherwise sets grad mode to the ``differentiable``
    default. The subclass's step does that and calls the step inside; once ``torch._dynamo``
    is imported (``--compile``, a user's ``torch.compile``) it calls torch's own wrapper. An
    optimizer whose step torch wraps otherwise is left as it is."""
    from torch.optim.optimizer import _use_grad_for_differentiable

    defer_disable(torch.optim.Optimizer)  # its construction's wrapped methods: none imports it
    if cls in _EAGER:
        return _EAGER[cls]
    wrapped, inner = cls.step, getattr(cls.step, "__wrapped__", None)
    if inner is None or getattr(wrapped, "__code__", None) \
            is not _use_grad_for_differentiable(len).__code__:
        return cls

    def step(self: Any, closure: Any = None) -> Any:
        if "torch._dynamo" in sys.modules:
            return wrapped(self, closure)
        before = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return inner(self, closure)
        finally:
            torch.set_grad_enabled(before)

    step.__doc__ = inner.__doc__
    _EAGER[cls] = type(cls.__name__, (cls,), {"step": step, "__doc__": cls.__doc__,
                                              "__module__": __name__})
    return _EAGER[cls]


__all__ = ["ddp_settings", "defer_disable", "eager"]
