"""What a parallel function is, checked once when it is made: the callable, which arguments
are scattered or broadcast, and how each output is reduced. Every rank runs a call from
this; :class:`shoal.parallel.functions.Function` adds the call itself."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shoal.errors import ShoalError

MODES = ("avg", "sum", "prod", "min", "max", "gather", None)
_IDS = itertools.count(1)


def _check_mode(mode: Any) -> Any:
    if mode not in MODES:
        raise ShoalError(f"unknown reduce mode {mode!r}; choose from avg, sum, prod, min, max, "
                         "gather or None")
    return mode


class FunctionSpec:
    """A function, its argument roles and its outputs' reduce modes; see :func:`shoal.function`."""

    def __init__(self, fn: Callable[..., Any], scatter: Sequence[str] = (),
                 broadcast: Sequence[str] = (),
                 reduce: str | None | Sequence[str | None] | Mapping[Any, str | None] = "avg",
                 name: str | None = None) -> None:
        if not callable(fn):
            raise ShoalError(f"shoal.function needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)
        self.id = next(_IDS)
        self.signature = inspect.signature(fn)
        self.scatter = (scatter,) if isinstance(scatter, str) else tuple(scatter)
        self.broadcast = (broadcast,) if isinstance(broadcast, str) else tuple(broadcast)
        params = self.signature.parameters
        for arg in (*self.scatter, *self.broadcast):
            p = params.get(arg)
            if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ShoalError(f"shoal.function({self.name}): {arg!r} is not a named parameter "
                                 f"of {self.name}{self.signature}")
        both = set(self.scatter) & set(self.broadcast)
        if both:
            raise ShoalError(f"shoal.function({self.name}): {sorted(both)} both scattered and broadcast")
        for option in ("batch", "num_slices"):
            if option in params:
                raise ShoalError(f"shoal.function({self.name}): a parameter named {option!r} clashes "
                                 "with the call option of that name; rename it")
        self.default_mode: Any = "avg"
        self.modes: dict[Any, Any] = {}
        if reduce is None or isinstance(reduce, str):
            self.default_mode = _check_mode(reduce)
        elif isinstance(reduce, Mapping):
            self.modes = {k: _check_mode(m) for k, m in reduce.items()}
        else:
            self.modes = {i: _check_mode(m) for i, m in enumerate(reduce)}

    def mode(self, key: Any) -> Any:
        """The reduce mode of output ``key`` (a tuple index or dict key)."""
        return self.modes.get(key, self.default_mode)

    def __repr__(self) -> str:
        return (f"shoal.function({self.name}, scatter={list(self.scatter)}, "
                f"broadcast={list(self.broadcast)})")
