"""Omnivore's search for the fastest way to a target accuracy, given a way to run a trial.

Hadjis, Zhang, Mitliagkas, Iter & Re (2016), "Omnivore: An Optimizer for Multi-device Deep
Learning on CPUs and GPUs", Section 5. Time to accuracy is hardware efficiency (time per
epoch) times statistical efficiency (epochs to the target); the best configuration is
neither fully synchronous nor fully asynchronous, and is found by measuring:

1. **Hardware efficiency.** For each family (``groups``, whose knob is the number of groups
   ``g``; the periodic strategies, whose knob is ``tau``), start at the synchronous end and
   move toward more asynchrony while an epoch gets at least 10% faster
   (:data:`FASTER`). Omnivore walks ``g``; shoal walks ``tau`` the same way.
2. **Statistical efficiency.** At each family's chosen knob, a grid of explicit momentum
   ``mu in {0, 0.3, 0.6, 0.9}`` x learning rate ``eta in {eta, eta/10}`` (:data:`MOMENTA`),
   each a short trial. A diverging branch is pruned: once a momentum diverges at a rate,
   larger momenta at that rate are not tried, and a rate at which ``mu = 0`` diverges is
   dropped. For ``groups``, while the best momentum is 0 the asynchrony already supplies
   more momentum than the run can use, so ``g`` shrinks (halves) and the grid is measured
   again (Omnivore's rule).
3. **Prediction.** A trial's test accuracy after each of its epochs gives the epochs to the
   target (:func:`epochs_to_target`), its last epoch the time per epoch; their product is
   the predicted time to the target. The winner is the candidate with the least.

Trials are the caller's (:class:`~shoal.plan.planner.Planner` runs real ``shoal train``
jobs; tests inject measurements). Every trial counts against the budget: one that would
not fit is skipped, and so is one that would cost more than the leader's predicted time to
the target (it cannot save more than that); the ranking uses what was measured.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.plan.trials import HARDWARE, INCUMBENT, STATISTICAL, Candidate, Phase, Trial

if TYPE_CHECKING:
    from shoal.config import TrainConfig

#: A step toward more asynchrony is kept when an epoch gets at least this much faster.
FASTER = 0.10
#: Omnivore's momentum grid, and its learning-rate grid as factors of the user's rate.
MOMENTA = (0.0, 0.3, 0.6, 0.9)
#: Strategies whose local steps are momentum SGD by definition (EAMSGD's): their grid starts
#: at the first momentum above 0 (at 0 they refuse to run, which would prune the rate).
MOMENTUM_ONLY = frozenset({"eamsgd", "async-measgd"})
RATE_FACTORS = (1.0, 0.1)
#: The periods a periodic family's walk tries, from the synchronous end (sync is tau = 1).
TAUS = (4, 16, 64)
#: How many leaders the refinement measures longer.
LEADERS = 4


def epochs_to_target(curve: Sequence[tuple[float, float, float]], target: float,
                     chance: float) -> float:
    """Epochs to reach ``target`` test accuracy, from a trial's ``(epoch, accuracy, s)``.

    Reached within the trial: interpolated linearly between the epoch before (accuracy
    ``chance`` at epoch 0) and the one that reached it. Otherwise extrapolated: the error
    ``1 - accuracy`` of the epochs above chance is fitted as a power law of the epoch,
    ``err = c * epoch^-b`` (least squares in log-log), solved for ``1 - target``; ``inf``
    where the error does not fall. With one epoch above chance the line runs from epoch 0
    at ``chance``.
    """
    previous = (0, chance)
    for epoch, acc, _ in curve:
        if acc >= target:
            e0, a0 = previous
            return e0 + (epoch - e0) * (target - a0) / (acc - a0) if acc > a0 else float(epoch)
        previous = (epoch, acc)
    points = [(e, 1.0 - a) for e, a, _ in curve if a > chance and a < 1.0]
    if len(points) == 1:  # a straight line from (0, chance): err falls linearly
        (e1, err1), err0 = points[0], 1.0 - chance
        fall = (err0 - err1) / e1
        return e1 + (err1 - (1.0 - target)) / fall if fall > 0 else math.inf
    if len(points) < 2:
        return math.inf
    xs = [math.log(e) for e, _ in points]
    ys = [math.log(err) for _, err in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    if slope >= 0:
        return math.inf
    exponent = (math.log(1.0 - target) - (my - slope * mx)) / slope
    return math.exp(exponent) if exponent < math.log(sys.float_info.max) else math.inf


OVER_BUDGET = "over the budget"
#: A trial that would cost more than the leader's predicted time to the target.
NOT_WORTH = "costs more than it could save"


@dataclass
class SearchSettings:
    target: float  #: test accuracy to reach
    epochs: float  #: the run's epochs after the probe's: a prediction beyond them is out of reach
    chance: float  #: accuracy at a trial's start: a guess's (1 / classes), a re-plan's run's
    budget_s: float  #: wall time all trials may take
    lr: float  #: the user's learning rate
    momentum: float | None  #: the user's momentum (``None``: auto, per strategy)
    trial_cost_s: float = 0.0  #: a trial's cost before any is measured (a re-plan knows it)


class Omnivore:
    """The search (see the module docstring). ``run(candidate, phase)`` runs one trial."""

    def __init__(self, settings: SearchSettings, run: Callable[[Candidate, Phase], Trial],
                 clock: Callable[[], float],
                 estimate: Callable[[Candidate, Phase], float | None] | None = None) -> None:
        self.settings, self._run, self._clock = settings, run, clock
        #: A trial's expected cost from what was measured (the planner's; ``None``: unknown).
        self._estimate = estimate
        self.trials: list[Trial] = []
        self.skipped: list[tuple[Candidate, Phase, str]] = []  # and why
        self.notes: list[str] = []  # what the walk and the grid decided, in words
        self._started = clock()

    # -- running, within the budget ---------------------------------------------------------
    def spent(self) -> float:
        return self._clock() - self._started

    def expected_cost(self, candidate: Candidate, phase: Phase = HARDWARE) -> float:
        """What ``candidate``'s trial is expected to take (start-ups aside): the most its
        configuration's tested trials took (the grid's points share a speed), else the
        ``estimate`` from what was measured (the planner's: the cost model,
        :mod:`shoal.strategies.cost`, fitted to a tested trial), else the median of all trials so
        far (a re-plan's first: ``trial_cost_s``)."""
        costs = [t.cost_s - t.startup_s for t in self.trials]
        own = [t.cost_s - t.startup_s for t in self.trials if not t.speed_only
               and (t.candidate.strategy, t.candidate.options, t.candidate.workers)
               == (candidate.strategy, candidate.options, candidate.workers)]
        if own:
            return max(own)
        guess = self._estimate(candidate, phase) if self._estimate is not None else None
        if guess is not None:
            return guess
        return statistics.median(costs) if costs else self.settings.trial_cost_s

    def leader_s(self) -> float:
        """The least predicted time to the target so far: the most any further trial can
        save (no configuration reaches the target in less than no time)."""
        return min((t.predicted_s for t in self.trials if t.ok), default=math.inf)

    def trial(self, candidate: Candidate, phase: Phase) -> Trial | None:
        """The trial of ``candidate`` (run once; ``None`` when the budget has no room, or
        when it would cost more than it could save: more than the leader's predicted time
        to the target)."""
        for t in self.trials:  # a speed-only trial does not answer the statistical phase
            if t.candidate == candidate and (phase == HARDWARE or not t.speed_only) \
                    and t.phase.scale == phase.scale:
                return t
        cost = self.expected_cost(candidate, phase) * phase.scale
        why = OVER_BUDGET if self.spent() + cost > self.settings.budget_s else \
            NOT_WORTH if cost > self.leader_s() else None
        if why is not None:
            self.skipped.append((candidate, phase, why))
            return None
        t = self._run(candidate, phase)
        t.phase = phase
        s = self.settings
        if t.ok:
            t.predicted_epochs = epochs_to_target(t.curve, s.target, s.chance)
            t.predicted_s = t.predicted_epochs * t.epoch_s \
                if t.predicted_epochs <= s.epochs else math.inf
        self.trials.append(t)
        return t

    # -- 1. hardware efficiency -------------------------------------------------------------
    def walk(self, sync: Trial, family: Candidate, knobs: Sequence[int]) -> Candidate | None:
        """From the synchronous end (``sync``'s trial: g = 1, and the limit of a period of
        one step), toward more asynchrony (``family`` at each of ``knobs`` in order) while an
        epoch gets at least :data:`FASTER` faster; the last that did (``None``: not even
        the first, so the family has nothing on sync)."""
        best, chosen = sync, None
        for knob in knobs:
            candidate = family.with_knob(knob)
            t = self.trial(candidate, HARDWARE)
            if t is None:
                self.notes.append(f"{candidate.label()}: {self.skipped[-1][2]}; the walk stops")
                break
            if not t.ok:
                break
            gain = 1 - t.epoch_s / best.epoch_s
            if gain >= FASTER:
                self.notes.append(f"{candidate.label()}: an epoch {gain:.0%} faster than "
                                  f"{best.candidate.label()}; kept")
                best, chosen = t, candidate
            else:
                self.notes.append(f"{candidate.label()}: an epoch {gain:.0%} faster than "
                                  f"{best.candidate.label()}, under {FASTER:.0%}; the walk stops")
                break
        return chosen

    # -- 2. statistical efficiency ----------------------------------------------------------
    def grid(self, base: Candidate) -> Trial | None:
        """Omnivore's momentum x learning-rate grid at ``base``, diverging branches pruned;
        the best trial (least predicted time, then highest accuracy)."""
        s = self.settings
        found: list[Trial] = []
        for factor in RATE_FACTORS:
            eta = s.lr * factor
            for mu in (m for m in MOMENTA if m > 0 or base.strategy not in MOMENTUM_ONLY):
                # The user's own setting is the walk's trial (None: as given).
                point = dataclasses.replace(base, momentum=None if mu == s.momentum else mu,
                                            lr=None if factor == 1.0 else eta)
                t = self.trial(point, STATISTICAL)
                if t is None:
                    continue
                if not t.ok:
                    self.notes.append(f"{t.candidate.label()} diverged: larger momenta at "
                                      f"lr {eta:g} pruned")
                    break
                found.append(t)
        return best_of(found)

    def momentum_of(self, c: Candidate) -> float | None:
        return c.momentum if c.momentum is not None else self.settings.momentum

    def groups(self, base: Candidate) -> Trial | None:
        """The grid for ``groups``; while its best momentum is 0, halve ``g`` and measure
        the grid again (kept while that does better)."""
        best = self.grid(base)
        while best is not None and self.momentum_of(best.candidate) == 0 and base.knob > 1:
            g = base.knob
            base = base.with_knob(g // 2)
            self.notes.append(f"groups: the best momentum at g = {g} is 0 (asynchrony gives "
                              f"enough): g shrinks to {base.knob}")
            smaller = self.grid(base)
            if smaller is None or _key(smaller) >= _key(best):
                break
            best = smaller
        return best

    # -- the whole search -------------------------------------------------------------------
    def search(self, syncs: Sequence[Candidate], families: Sequence[Candidate],
               incumbent: Candidate | None = None) -> list[Trial]:
        """Measure ``syncs`` (sync in each process layout; the fastest is the synchronous
        end), walk every family of ``families`` (each at any knob) from there, then run the
        grids, fastest first; returns every trial, best first. A re-plan measures the
        ``incumbent`` (the configuration training now) first: however little of the search
        its budget holds, the new winner is compared with it."""
        if incumbent is not None:
            self.trial(incumbent, INCUMBENT)
        measured = [t for t in (self.trial(c, HARDWARE) for c in syncs) if t is not None and t.ok]
        if not measured:
            return rank(self.trials)
        sync = min(measured, key=lambda t: t.epoch_s)
        chosen = [sync.candidate]
        for family in families:
            knobs = group_knobs(family.workers)[1:] if family.strategy == "groups" else TAUS
            picked = self.walk(sync, family, knobs)
            if picked is not None:
                chosen.append(picked)
            elif any(t.candidate.family() == family.family() for t in self.trials):
                self.notes.append(f"{family.family()}: no step toward asynchrony made an epoch "
                                  f"{FASTER:.0%} faster than sync; not tuned further")
        speed = {c: self.trial(c, HARDWARE) for c in chosen}
        for c in sorted(chosen, key=lambda c: speed[c].epoch_s if speed[c] is not None
                        else math.inf):
            (self.groups if c.strategy == "groups" else self.grid)(c)
        self.refine()
        return rank(self.trials)

    # -- 3. the leaders, measured longer ----------------------------------------------------
    def refine(self) -> None:
        """Successive halving on the leaders while the budget holds: the best
        :data:`LEADERS` tested configurations train trials twice as long (then the better
        half of those, twice as long again), and their longest trial is what ranks them. A
        short trial's extrapolation is what separates close leaders; a longer one measures
        them where the run goes."""
        leaders = [t for t in rank(self.trials) if t.ok and t.curve][:LEADERS]
        scale = 1
        while len(leaders) > 1:
            scale *= 2
            longer = [self.trial(t.candidate, Phase.refine(scale)) for t in leaders]
            done = [t for t in longer if t is not None and t.ok and t.curve]
            if len(done) < len(leaders):
                break
            leaders = sorted(done, key=_key)[:len(done) // 2]


@dataclass
class Plan:
    """What the search found: every trial (best first), the winner's run settings, why."""

    trials: list[Trial]
    skipped: list[tuple[Candidate, Phase, str]]  #: not run, and why
    winner: TrainConfig | None
    why: str
    notes: list[str]
    planning_s: float
    files: dict[str, Path] = field(default_factory=dict)  #: what was written, by kind

    def or_sync(self, sync: TrainConfig) -> tuple[TrainConfig, str, str]:
        """What a run planned from sync's probe trains, its label and why: the winner, or
        ``sync`` (set to go on from the probe) where no trial is predicted to reach the
        target (then not the most accurate trial, which a plan without a probe keeps)."""
        if self.winner is None or not self.trials or not math.isfinite(self.trials[0].predicted_s):
            return (sync, "sync (no trial is predicted to reach the target)",
                    f"{self.why.split('; ')[0]}; sync goes on")
        return self.winner, self.trials[0].candidate.label(), self.why

    def to_dict(self, settings: SearchSettings) -> dict[str, Any]:
        def trial(t: Trial) -> dict[str, Any]:
            c = t.candidate
            return {"label": c.label(), "strategy": c.strategy, "options": dict(c.options),
                    "workers": c.workers, "threads": c.threads, "momentum": c.momentum,
                    "lr": c.lr, "phase": str(t.phase), "curve": [list(p) for p in t.curve],
                    "epoch_s": _finite(t.epoch_s), "diverged": t.diverged, "error": t.error,
                    "predicted_epochs": _finite(t.predicted_epochs),
                    "predicted_s": _finite(t.predicted_s), "cost_s": t.cost_s,
                    "startup_s": t.startup_s, "speed_only": t.speed_only}

        return {
            "target_accuracy": settings.target, "budget_s": settings.budget_s,
            "planning_s": self.planning_s, "epochs": settings.epochs,
            "why": self.why, "notes": self.notes,
            "winner": self.winner.to_dict() if self.winner is not None else None,
            "trials": [trial(t) for t in self.trials],
            "skipped": [{"label": c.label(), "phase": str(phase), "why": why}
                        for c, phase, why in self.skipped],
        }


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def group_knobs(workers: int) -> list[int]:
    """g from 1 (synchronous: sync) up: the powers of two below ``workers``, then
    ``workers``."""
    knobs, g = [], 1
    while g < workers:
        knobs.append(g)
        g *= 2
    return knobs + [workers]


def _key(t: Trial) -> tuple[float, float]:
    return (t.predicted_s, -t.accuracy)


def best_of(trials: Sequence[Trial]) -> Trial | None:
    ok = [t for t in trials if t.ok]
    return min(ok, key=_key) if ok else None


def rank(trials: Sequence[Trial]) -> list[Trial]:
    """Measured trials, best first: least predicted time to the target, then accuracy; a
    configuration's longest trial ranks it (its shorter ones follow the others)."""
    longest: dict[Candidate, float] = {}
    for t in trials:
        if t.ok and t.curve:
            longest[t.candidate] = max(longest.get(t.candidate, 0), t.phase.scale)
    return sorted(trials, key=lambda t: (not t.ok, t.phase.scale < longest.get(t.candidate, 0),
                                         *_key(t)))


def explain(ranked: Sequence[Trial], settings: SearchSettings) -> str:
    """Why the winner won, in a sentence or two."""
    if not ranked or not ranked[0].ok or math.isinf(ranked[0].predicted_s):
        best = ranked[0] if ranked and ranked[0].ok else None
        return ("no candidate is predicted to reach "
                f"{100 * settings.target:g}% within {round(settings.epochs, 1):g} epochs"
                + (f"; the most accurate trial, {best.candidate.label()}, is kept"
                   if best is not None else ""))
    w = ranked[0]
    text = (f"{w.candidate.label()}: predicted {w.predicted_s:.1f} s to "
            f"{100 * settings.target:g}% ({w.predicted_epochs:.1f} epochs of {w.epoch_s:.2f} s)")
    runner = next((t for t in ranked[1:] if t.ok and t.candidate.strategy != w.candidate.strategy),
                  None)
    if runner is not None:
        ratio = runner.predicted_s / w.predicted_s if math.isfinite(runner.predicted_s) else math.inf
        text += (f"; the best other strategy, {runner.candidate.label()}, "
                 + (f"{runner.predicted_s:.1f} s ({ratio:.2f}x)" if math.isfinite(ratio)
                    else "is not predicted to reach it"))
    return text
