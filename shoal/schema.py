"""Typed settings: dataclass fields that carry their command-line flag, and the checks every
value passes, whether it comes from a flag, a config file or Python code.

The run settings (:class:`shoal.config.TrainConfig`) and every strategy's ``Options`` are
dataclasses whose fields become flags (``batch_size`` -> ``--batch-size``) through
:func:`add_flag`. A field's ``metadata`` holds all its flag needs, so a new setting is one
line (:func:`setting` writes it):

- ``help``: the flag's help, or a function returning it (for names a registry holds);
- ``choices``: the values it takes (argparse checks a flag's, :func:`check_rules` a file's);
- ``metavar``, ``nargs`` and ``const`` as in argparse; ``parse``: text -> value, for values
  that are not one number or word (a shape, a list);
- ``at_least`` (a number) or ``positive``: the range :func:`check_rules` checks; ``at_most``:
  a function returning the upper bound and why (what this machine can hold);
- ``section``: the help group of this field and of those after it; ``flag=False``: no flag;
- ``kind``: what a value is, in words, for the error of a value of the wrong type (a field
  of two types: ``an integer, auto or auto:N``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import numbers
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from shoal.errors import ShoalError

#: Every integer setting is at most this (what a C ``int64`` holds), so no count overflows
#: the tensors and C++ code it reaches.
MAX_INT = 2**63 - 1
#: Every float setting is at most this in magnitude (the largest float32): learning rates,
#: weight decay and strategy rates multiply float32 tensors, which cannot hold more.
MAX_FLOAT = 3.4028234663852886e38
#: A duration setting (``--plan-budget``, ``--replan-every``) is at most a week: beyond any
#: plan, and within what the waits it becomes (process and thread timeouts) can hold.
MAX_DURATION_S = 7 * 24 * 3600.0
#: Numbers YAML 1.1 reads as strings (an exponent without a dot, or one without a sign:
#: ``1e-3``, ``1.0e3``), which ``float()`` and the command-line flags read as numbers.
_YAML_MISSED_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


def setting(default: Any = dataclasses.MISSING, help: str | Callable[[], str] = "", *,
            factory: Callable[[], Any] | None = None, **flag: Any) -> Any:
    """A dataclass field with its flag's metadata (the keys in this module's docstring);
    ``factory`` for a mutable default."""
    metadata = {"help": help, **flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(name: str) -> str:
    """The flag of the setting ``name``: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Every field's annotation of the dataclass ``cls``, resolved (``int | None``, ...);
    annotations that do not resolve stay text (``"int | None"``), which any value passes."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a user's Options may name types not importable here
        return {f.name: f.type for f in dataclasses.fields(cls)}


# -- flags -----------------------------------------------------------------------------------
def parse_shape(text: str) -> tuple[int, ...]:
    """``3x32x32`` (or ``3,32,32``) -> ``(3, 32, 32)``."""
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d)
    except ValueError:
        dims = ()
    if not dims:
        raise argparse.ArgumentTypeError(f"expected a shape like 3x32x32, got {text!r}")
    return dims


def parse_floats(text: str) -> tuple[float, ...]:
    """``30,60`` -> ``(30.0, 60.0)``."""
    try:
        return tuple(float(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 30,60, got {text!r}") from None


def parse_ints(text: str) -> list[int]:
    """``1,2,4`` -> ``[1, 2, 4]``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}")
    return values


def parse_threads(text: str) -> list[int | None]:
    """``auto,1,2`` -> ``[None, 1, 2]`` (``None``: cores // workers)."""
    out: list[int | None] = []
    for v in (t.strip() for t in text.split(",") if t.strip()):
        if v == "auto":
            out.append(None)
        elif v.isdigit():
            out.append(int(v))
        else:
            raise argparse.ArgumentTypeError(f"expected auto or numbers like 1,2, got {text!r}")
    return out or [None]


def parse_names(text: str) -> list[str]:
    """``a, b,`` -> ``["a", "b"]``."""
    return [v.strip() for v in text.split(",") if v.strip()]


def float_or_text(text: str) -> float | str:
    """``0.9`` -> 0.9; other text (``auto``, ``auto:0.95``, a mistake) stays text, for the
    setting's own check."""
    try:
        return float(text)
    except ValueError:
        return text


def int_or_text(text: str) -> int | str:
    """``2`` -> 2; other text (``auto``, a mistake) stays text, for the setting's own check."""
    try:
        return int(text)
    except ValueError:
        return text


def parse_step_window(value: Any) -> tuple[int, int]:
    """``"20:25"``, ``[20, 25]`` or ``20`` -> ``(20, 25)`` / ``(20, 20)``: steps, both included."""
    try:
        if isinstance(value, str):
            parts = [int(v) for v in value.split(":")]
        elif isinstance(value, bool):
            parts = []
        elif isinstance(value, int):
            parts = [value]
        else:
            parts = [int(v) for v in value]
    except (TypeError, ValueError):
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise ShoalError(f"--profile must be FIRST:LAST steps with 1 <= FIRST <= LAST, got {value!r}")
    return parts[0], parts[1]


def parse_duration(text: str, flag: str) -> float:
    """``90``, ``90s``, ``5m``, ``1.5h`` -> seconds, more than none and at most
    :data:`MAX_DURATION_S`; otherwise a one-line :class:`ShoalError` naming ``flag``."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    value = str(text).strip().lower()
    scale = units.get(value[-1:])
    try:
        seconds = float(value[:-1] if scale is not None else value) * (scale or 1.0)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ShoalError(f"{flag} must be a duration like 90s, 5m or 1h, got {show_value(text)}")
    if seconds <= 0:
        raise ShoalError(f"{flag} must be a positive duration like 90s, 5m or 1h, "
                         f"got {show_value(text)}")
    if seconds > MAX_DURATION_S:
        raise ShoalError(f"{flag} must be at most a week (168h), got {show_value(text)}")
    return seconds


def _base_type(hint: Any) -> Any:
    """``int | None`` -> ``int``; a text annotation (``"float | None"``) -> ``float``."""
    if isinstance(hint, str):
        return {"int": int, "float": float, "bool": bool}.get(hint.split("|")[0].strip(), str)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and args:
        return args[0]
    return hint


def show_default(value: Any) -> str:
    """A default as the help shows it (``3x32x32``, ``0.05``); ``""`` for none."""
    if value is None or value == () or value == "":
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):  # a shape 3x32x32, a list of names a,b
        return ("," if any(isinstance(v, str) for v in value) else "x").join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_flag(group: Any, f: dataclasses.Field, hint: Any, *, dest: str | None = None,
             default: Any = argparse.SUPPRESS, negatable: bool = False, help: str | None = None,
             note: str = "") -> None:
    """Add the flag of the field ``f`` (annotation ``hint``) to the argparse ``group``.

    ``default``: the flag's value when it is not given; ``SUPPRESS`` (leave it out of the
    namespace, so a config file or the field's default applies) shows the field's default.
    A ``bool`` is a switch, with a ``--no-`` twin when ``negatable``. ``help`` replaces
    the field's; ``note`` follows it (after the default, which the help states unless its
    text already speaks of one).
    """
    meta = f.metadata
    text = meta.get("help", "") if help is None else help
    text = text() if callable(text) else text
    kind = _base_type(hint)
    shown = f.default if default is argparse.SUPPRESS else default
    if shown is dataclasses.MISSING or (kind is bool and not negatable):
        shown = None
    if "default" not in text and show_default(shown):
        text = f"{text} (default {show_default(shown)})".strip()
    options: dict[str, Any] = {"dest": dest or f.name, "default": default,
                               "help": f"{text} {note}".strip()}
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
    else:
        parse = _text_parser(f, kind)
        choices = meta.get("choices")
        options.update(type=parse, choices=choices,
                       metavar=meta.get("metavar", None if choices else f.name.upper()))
        options.update({k: meta[k] for k in ("nargs", "const") if k in meta})
    group.add_argument(flag_name(f.name), **options)


def _text_parser(f: dataclasses.Field, kind: Any) -> Callable[[str], Any]:
    """What turns the text of field ``f``'s flag into its value (``kind``: its base type)."""
    return f.metadata.get("parse", kind if kind in (int, float) else str)


def parse_text(f: dataclasses.Field, hint: Any, text: str) -> Any:
    """The value of field ``f`` (annotation ``hint``) written as its flag's text, as in a
    spec such as ``local-sgd:tau=16`` (a ``bool``: true or false); a one-line error naming
    the flag otherwise."""
    kind = _base_type(hint)
    if kind is bool:
        if text.strip().lower() not in ("true", "false"):
            raise ShoalError(f"{flag_name(f.name)} must be true or false, got {show_value(text)}")
        return text.strip().lower() == "true"
    try:
        return _text_parser(f, kind)(text)
    except ValueError:
        raise ShoalError(f"{flag_name(f.name)} must be {f.metadata.get('kind') or _describe(hint)}, "
                         f"got {show_value(text)}") from None


# -- checks ----------------------------------------------------------------------------------
def show_value(value: Any) -> str:
    """``repr(value)``, cut short: error lines stay one readable line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:45] + "..." + text[-10:]


def check_rules(settings: Any, name: Callable[[str], str] = flag_name) -> None:
    """Check each field of the dataclass ``settings`` against its metadata's ``choices``,
    ``at_least``, ``positive`` and ``at_most`` (in field order); a :class:`ShoalError` begins with
    ``name(field)``. ``None`` passes: the annotation said whether it may be."""
    for f in dataclasses.fields(settings):
        value, meta = getattr(settings, f.name), f.metadata
        if value is None:
            continue
        choices = meta.get("choices")
        if choices is not None and value not in choices:
            raise ShoalError(f"{name(f.name)} must be one of {', '.join(choices)}, "
                             f"got {value!r}")
        nan = isinstance(value, float) and not math.isfinite(value)
        low = meta.get("at_least")
        if low is not None and (nan or value < low):
            raise ShoalError(f"{name(f.name)} must be at least {low}, got {show_value(value)}")
        if meta.get("positive") and (nan or value <= 0):
            raise ShoalError(f"{name(f.name)} must be a positive number, "
                             f"got {show_value(value)}")
        high, why = meta["at_most"]() if "at_most" in meta else (None, "")
        if high is not None and value > high:
            raise ShoalError(f"{name(f.name)} must be at most {high} ({why}), got {show_value(value)}")


def _describe(hint: Any) -> str:
    """What a value of type ``hint`` is, in words: ``an integer``, ``a list of numbers``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin in (tuple, list):
        item = args[0] if args else Any
        return "a list of " + {int: "integers", float: "numbers", str: "strings",
                               bool: "true/false values"}.get(item, "values")
    if origin is dict or hint is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number",
            str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))


_INVALID = object()


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as a ``hint`` (ints become floats for ``float``, lists tuples for ``tuple``),
    or ``_INVALID``. Annotations it does not know pass any value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None) and (out := _convert(value, arg)) is not _INVALID:
                return out
        return _INVALID
    if hint is bool:
        return value if isinstance(value, bool) else _INVALID
    if hint is int:  # Integral: NumPy's integers too (from Python code)
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return int(value) if ok else _INVALID
    if hint is float:
        if isinstance(value, str) and _YAML_MISSED_FLOAT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return _INVALID
        try:
            return float(value)
        except OverflowError:  # an int beyond any float
            return _INVALID
    if hint is str:
        return value if isinstance(value, str) else _INVALID
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return _INVALID
        item = args[0] if args else Any
        items = [_convert(v, item) for v in value]
        if any(v is _INVALID for v in items):
            return _INVALID
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        return dict(value) if isinstance(value, dict) else _INVALID
    return value


def _numbers(value: Any) -> list[int | float]:
    """The numbers in ``value`` (itself, or the items of a tuple/list)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [float(v) if isinstance(v, float) else int(v) for v in items
            if isinstance(v, (numbers.Integral, float)) and not isinstance(v, bool)]


def field_kind(cls: type, name: str) -> str | None:
    """What a value of the dataclass ``cls``'s field ``name`` is, in words, where its
    metadata says (``kind``: for a field of two types, such as ``--tau 4`` or ``auto``)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("kind")
    return None


def check_value(value: Any, hint: Any, name: str, bounds: bool = True,
                kind: str | None = None) -> Any:
    """``value`` checked against the annotation ``hint`` and normalized; otherwise a
    one-line :class:`ShoalError` that begins with ``name`` (a flag, or ``file: key``) and
    says what the value must be (``kind``, else the annotation in words).

    With ``bounds``, also :func:`check_bounds`.
    """
    out = _convert(value, hint)
    if out is _INVALID:
        raise ShoalError(f"{name} must be {kind or _describe(hint)}, got {show_value(value)}")
    _check_text(out, name)
    if bounds:
        check_bounds(out, name)
    return out


def _check_text(value: Any, name: str) -> None:
    if isinstance(value, str) and "\x00" in value:  # a file may hold one, no path or argv can
        raise ShoalError(f"{name} must not contain a NUL character, got {show_value(value)}")


def check_bounds(value: Any, name: str) -> None:
    """Floats must be finite and within float32's range, integers fit in 64 bits (also
    inside lists), strings hold no NUL (no path can: a file may hold one, a command line
    cannot); otherwise a one-line :class:`ShoalError` beginning with ``name``."""
    _check_text(value, name)
    for number in _numbers(value):
        if isinstance(number, float) and not math.isfinite(number):
            what = "finite" if isinstance(value, (list, tuple)) else "a finite number"
            raise ShoalError(f"{name} must be {what}, got {show_value(value)}")
        if isinstance(number, float) and abs(number) > MAX_FLOAT:
            raise ShoalError(f"{name} must be at most {MAX_FLOAT:.3g} in magnitude (float32), "
                             f"got {number:g}")
        if isinstance(number, int) and abs(number) > MAX_INT:
            raise ShoalError(f"{name} must be at most {MAX_INT}, got {show_value(number)}")
