"""One typed configuration for a training run, validated once before any worker starts.

Values come from, in increasing priority: the defaults below, a ``--config`` YAML/JSON file,
and command-line flags. The resolved configuration is saved as ``config.json`` in the run
directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "bar", "plain", "none")


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
        """Raise :class:`ShoalError` naming the first bad value; return ``self``."""
        def positive(name: str, value: float | None, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if value is None or not math.isfinite(value) or value < 1:
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
        return self

    # -- (de)serialization ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ShoalError(f"unknown configuration keys: {', '.join(unknown)}")
        clean = {}
        for k, v in values.items():
            clean[k] = tuple(v) if isinstance(v, list) and k != "strategy_options" else v
        return cls(**clean)


def parse_step_window(value: Any) -> tuple[int, int]:
    """``"20:25"``, ``[20, 25]`` or ``20`` -> ``(20, 25)`` / ``(20, 20)``: steps, both included."""
    try:
        if isinstance(value, str):
            parts = [int(v) for v in value.split(":")]
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


def default_threads(local_workers: int) -> int:
    """Cores available to this process divided among the workers on this node."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_workers))
