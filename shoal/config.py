"""One typed configuration for a training run, validated once before any worker starts.

Values come from, in increasing priority: the defaults below, a ``--config`` YAML/JSON file,
and command-line flags. The resolved configuration is saved as ``config.json`` in the run
directory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "bar", "plain", "none")

#: ``--seed`` is at most this (NumPy's range): seeds derived from it (``seed * 1_000_003 +
#: epoch`` for the data order, ``seed + 10_007 * (rank + 1)`` for augmentation) must still fit
#: the 64 bits ``torch.manual_seed`` takes.
MAX_SEED = 2**32 - 1
#: ``--timeout`` and ``--heartbeat-timeout`` are at most a week, in seconds: far beyond any
#: sane wait, and far below what ``timedelta`` (about 8.6e13 s) and Gloo's rendezvous (which
#: fails at once from about 1e10 s) can hold.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: Every integer setting is at most this (what a C ``int64`` holds), so no count overflows
#: the tensors and C++ code it reaches.
MAX_INT = 2**63 - 1
#: Every float setting is at most this in magnitude (the largest float32): learning rates,
#: weight decay and strategy rates multiply float32 tensors, which cannot hold more.
MAX_FLOAT = 3.4028234663852886e38
#: Numbers YAML 1.1 reads as strings (an exponent without a dot, or one without a sign:
#: ``1e-3``, ``1.0e3``), which ``float()`` and the command-line flags read as numbers.
_YAML_MISSED_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


@dataclass
class TrainConfig:
    """Everything ``shoal train`` needs; see ``docs/cli.md`` for each field."""

    # what to train
    model: str = "lenet5"
    dataset: str = "digits"
    data_dir: str | None = None
    synthetic_shape: tuple[int, ...] = (3, 32, 32)
    synthetic_classes: int = 10
    synthetic_samples: int = 2048
    image_size: int | None = None
    augment: bool = False
    # where and how
    workers: int | None = None  # None: one per GPU with --device cuda, else 1
    threads_per_worker: int | None = None  # None: cores // workers on this node
    device: str = "auto"
    strategy: str = "sync"
    strategy_options: dict[str, Any] = field(default_factory=dict)
    timeout: float = 300.0
    heartbeat_timeout: float = 10.0  # seconds a silent worker may go unheard before it is hung
    max_restarts: int = 0  # restart the job from its last checkpoint this often on failure
    # optimization
    epochs: int = 10
    batch_size: int = 16
    global_batch_size: int | None = None
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    schedule: str = "cosine"
    warmup_epochs: float = 0.0
    lr_milestones: tuple[float, ...] = ()
    lr_gamma: float = 0.1
    scale_lr: bool = False
    seed: int = 0
    # outputs
    out: str = "runs/latest"
    overwrite: bool = False
    resume: str | None = None  # "" means <out>/checkpoint.pt
    checkpoint_every: int = 0  # steps; 0: at every epoch's end
    stop_at_step: int | None = None
    log_every: int = 10
    eval_every: int = 1
    progress: str = "auto"
    debug: bool = False
    # observability
    trace: bool = False  # write trace.json (Chrome trace format, one lane per rank)
    profile: tuple[int, ...] | None = None  # (first, last) step handed to torch.profiler
    tensorboard: bool = False  # also log scalars to <out>/tensorboard

    # -- derived --------------------------------------------------------------------------
    def world_size(self) -> int:
        return self.workers if self.workers is not None else 1

    def global_batch(self, world: int) -> int:
        return self.global_batch_size if self.global_batch_size else self.batch_size * world

    def base_lr(self, world: int) -> float:
        """The peak learning rate: ``lr``, times the workers with ``--scale-lr``."""
        return self.lr * world if self.scale_lr else self.lr

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.out) / "checkpoint.pt"

    @property
    def resume_path(self) -> Path | None:
        if self.resume is None:
            return None
        return Path(self.resume) if self.resume else self.checkpoint_path

    # -- validation -----------------------------------------------------------------------
    def validate(self) -> TrainConfig:
        """Raise :class:`ShoalError` naming the first bad value; return ``self``.

        Every field is first checked against its annotation (an ``int`` field takes no float,
        string or bool; a ``float`` field takes ints; tuples take lists) and normalized
        (``float`` fields hold floats, sequences tuples); then each setting's own range;
        last what :func:`check_bounds` asks of every field (floats finite and within
        float32, ints within int64, no NUL in text).
        """
        hints = {k: v for k, v in field_types().items()
                 if k != "profile" or self.profile is None}  # parse_step_window checks it
        for name, hint in hints.items():
            value = check_value(getattr(self, name), hint, _flag(name), bounds=False)
            if name == "strategy_options":
                value = {str(k).replace("-", "_"): v for k, v in value.items()}
            setattr(self, name, value)

        def positive(name: str, value: float | None, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if value is None or value < 1 or (isinstance(value, float) and not math.isfinite(value)):
                flag = "--" + name.replace("_", "-")
                raise ShoalError(f"{flag} must be at least 1, got {value}")

        positive("workers", self.workers, allow_none=True)
        positive("threads_per_worker", self.threads_per_worker, allow_none=True)
        positive("epochs", self.epochs)
        positive("batch_size", self.batch_size)
        positive("global_batch_size", self.global_batch_size, allow_none=True)
        positive("log_every", self.log_every)
        positive("eval_every", self.eval_every)
        positive("synthetic_classes", self.synthetic_classes)
        positive("synthetic_samples", self.synthetic_samples)
        positive("image_size", self.image_size, allow_none=True)
        positive("stop_at_step", self.stop_at_step, allow_none=True)
        if self.global_batch_size is not None and self.workers is not None \
                and self.global_batch_size < self.workers:
            raise ShoalError(f"--global-batch-size {self.global_batch_size} is smaller than "
                             f"--workers {self.workers}")
        for name, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                              ("device", DEVICES), ("progress", PROGRESS)):
            value = getattr(self, name)
            if value not in choices:
                raise ShoalError(f"--{name} must be one of {', '.join(choices)}, got {value!r}")
        for name in ("lr", "timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ShoalError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        for name in ("momentum", "weight_decay", "warmup_epochs"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ShoalError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        for name in ("timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if value > MAX_TIMEOUT_S:
                raise ShoalError(f"--{name.replace('_', '-')} must be at most "
                                 f"{MAX_TIMEOUT_S:.0f} seconds (a week), got {value:g}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ShoalError(f"--seed must be from 0 to {MAX_SEED}, got {show_value(self.seed)}")
        if not self.out:
            raise ShoalError("--out must name a directory, got ''")
        if self.momentum >= 1:
            raise ShoalError(f"--momentum must be below 1, got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ShoalError("--nesterov needs --momentum > 0")
        if not (0 < self.lr_gamma <= 1):
            raise ShoalError(f"--lr-gamma must be in (0, 1], got {self.lr_gamma}")
        if any(m <= 0 for m in self.lr_milestones):
            raise ShoalError(f"--lr-milestones must be positive epochs, got {self.lr_milestones}")
        if self.max_restarts < 0:
            raise ShoalError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.checkpoint_every < 0:
            raise ShoalError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if len(self.synthetic_shape) == 0 or any(d < 1 for d in self.synthetic_shape):
            raise ShoalError(f"--synthetic-shape must be positive sizes, got {self.synthetic_shape}")
        if self.resume is not None and self.overwrite:
            raise ShoalError("--resume and --overwrite contradict each other")
        if self.profile is not None:
            self.profile = parse_step_window(self.profile)
        for name in hints:  # what the checks above leave: floats finite float32, ints int64
            check_bounds(getattr(self, name), _flag(name))
        if self.scale_lr and self.workers is not None and self.base_lr(self.workers) > MAX_FLOAT:
            raise ShoalError(f"--lr {self.lr:g} --scale-lr with {self.workers} workers is "
                             f"beyond float32 ({MAX_FLOAT:.3g})")
        return self

    # -- (de)serialization ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str | None = None) -> TrainConfig:
        """A configuration from ``values``; :meth:`validate` checks it. With ``source`` (say
        ``"config file run.yaml"``), the values' types are checked here, errors naming the
        source and the key."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(names))
        if unknown:
            shown = ", ".join(show_value(u) if not u.isidentifier() else u for u in unknown)
            raise ShoalError(f"{source + ': ' if source else ''}unknown configuration keys: "
                             f"{shown}")
        if source is not None:
            check_values(values, source)
        clean = {}
        for k, v in values.items():
            clean[k] = tuple(v) if isinstance(v, list) and k != "strategy_options" else v
        return cls(**clean)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def field_types() -> dict[str, Any]:
    """Every :class:`TrainConfig` field's annotation, resolved (``int | None``, ...)."""
    return typing.get_type_hints(TrainConfig)


def check_values(values: dict[str, Any], source: str) -> None:
    """Check the types of configuration ``values`` read from ``source`` (a config file),
    naming the source and the key of the first wrong one."""
    hints = field_types()
    for key, value in values.items():
        if key == "profile" and value is not None:
            try:
                parse_step_window(value)
            except ShoalError as exc:
                raise ShoalError(f"{source}: profile: {exc}") from None
        elif key in hints:  # the ranges: validate(), whose errors the caller may rename
            check_value(value, hints[key], f"{source}: {key}", bounds=False)


def show_value(value: Any) -> str:
    """``repr(value)``, cut short: error lines stay one readable line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:45] + "..." + text[-10:]


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


def check_value(value: Any, hint: Any, name: str, bounds: bool = True) -> Any:
    """``value`` checked against the annotation ``hint`` and normalized; otherwise a
    one-line :class:`ShoalError` that begins with ``name`` (a flag, or ``file: key``).

    With ``bounds``, also :func:`check_bounds`.
    """
    out = _convert(value, hint)
    if out is _INVALID:
        raise ShoalError(f"{name} must be {_describe(hint)}, got {show_value(value)}")
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


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML or JSON mapping of configuration keys (dashes or underscores)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ShoalError(f"config file {p} does not exist")
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ShoalError(f"config file {p}: cannot parse: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ShoalError(f"config file {p}: expected a mapping of keys to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
