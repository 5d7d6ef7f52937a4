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


__all__ = ["ddp_settings", "defer_disable"]
