"""What the search (:mod:`shoal.plan.search`) measures: a :class:`Candidate` configuration,
the :class:`Phase` of the search a trial serves, and what the :class:`Trial` measured."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from shoal.strategies.communication import Pattern
from shoal.strategies.cost import pattern_of


class Stage(enum.Enum):
    """The parts of the search, in its order."""

    INCUMBENT = "incumbent"  #: a re-plan's configuration training now, measured first
    HARDWARE = "hardware"  #: the walk toward asynchrony: time per epoch
    STATISTICAL = "statistical"  #: the momentum x learning-rate grid
    REFINE = "refine"  #: the leaders, measured longer


@dataclass(frozen=True)
class Phase:
    """The part of the search a trial serves, and how many times the usual length it trains
    (a refinement's 2, 4, ...). Written as ``hardware``, ``refine x4`` in plan.json."""

    stage: Stage
    scale: int = 1

    def __str__(self) -> str:
        return f"{self.stage.value} x{self.scale}" if self.stage is Stage.REFINE else self.stage.value

    @classmethod
    def refine(cls, scale: int) -> Phase:
        return cls(Stage.REFINE, scale)


INCUMBENT, HARDWARE, STATISTICAL = (Phase(Stage.INCUMBENT), Phase(Stage.HARDWARE),
                                    Phase(Stage.STATISTICAL))


@dataclass(frozen=True)
class Candidate:
    """One configuration a trial can run: a strategy with its knob, the workers and their
    threads, and (``None``: the user's) explicit momentum and learning rate."""

    strategy: str
    options: tuple[tuple[str, Any], ...] = ()
    workers: int = 1
    threads: int | None = None
    momentum: float | None = None
    lr: float | None = None

    @property
    def knob(self) -> int:
        """``g`` for groups, ``tau`` for the periodic strategies, 1 for sync."""
        opts = dict(self.options)
        return int(opts.get("groups", opts.get("tau", 1)))

    @property
    def period(self) -> int:
        """``tau`` for the periodic strategies (their exchange every so many steps), else 1."""
        return int(dict(self.options).get("tau", 1))

    @property
    def knob_name(self) -> str:
        """The option a walk moves: ``groups`` for groups, else ``tau``."""
        return "groups" if self.strategy == "groups" else "tau"

    def with_knob(self, value: int) -> Candidate:
        opts = {**dict(self.options), self.knob_name: value}
        return dataclasses.replace(self, options=tuple(sorted(opts.items())))

    def pattern(self) -> Pattern | None:
        """What this configuration's workers exchange: its strategy's pattern."""
        return pattern_of(self.strategy, dict(self.options), self.workers)

    def family(self) -> str:
        """Its strategy and options but the knob (``local-sgd``, ``local-sgd:host_sync=True``):
        what a walk moves along."""
        return self._named([(k, v) for k, v in self.options if k != self.knob_name])

    def _named(self, options: list[tuple[str, Any]] | tuple[tuple[str, Any], ...]) -> str:
        opts = ",".join(f"{k}={v}" for k, v in options)
        return f"{self.strategy}{':' + opts if opts else ''}"

    def label(self) -> str:
        text = f"{self._named(self.options)} {self.workers}x{self.threads or 'auto'}"
        if self.momentum is not None:
            text += f" mu={self.momentum:g}"
        if self.lr is not None:
            text += f" lr={self.lr:g}"
        return text


@dataclass
class Trial:
    """What a trial measured. ``curve``: (epoch, test accuracy, elapsed s) after each epoch;
    ``epoch_s``: seconds an epoch takes (its last one: warm, evaluation included);
    ``diverged``: the loss became non-finite or grew; ``error``: it failed otherwise."""

    candidate: Candidate
    curve: list[tuple[float, float, float]] = field(default_factory=list)
    epoch_s: float = math.inf
    diverged: bool = False
    error: str | None = None
    cost_s: float = 0.0  # wall time the trial took, start-up included
    startup_s: float = 0.0  # of which starting its planning session (0: one was running)
    phase: Phase = HARDWARE
    predicted_epochs: float = math.inf
    predicted_s: float = math.inf

    #: Measured its speed only (an asynchronous candidate's walk step: a few steps of a job,
    #: untested): ``epoch_s``, no ``curve``.
    speed_only: bool = False
    comm_fraction: float | None = None  # of its steps' time spent communicating

    @property
    def ok(self) -> bool:
        return not self.diverged and self.error is None and (bool(self.curve) or self.speed_only)

    @property
    def accuracy(self) -> float:
        return self.curve[-1][1] if self.curve else 0.0
