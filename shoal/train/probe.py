"""The probe of ``shoal train --strategy auto``: a sync run that times its first steps and
decides whether planning can pay for itself (``--plan-probe STEPS``, set by auto).

Planning pays only where the run is long against what a plan costs: a planning session's
start-up and at least one trial. So ``auto`` starts training ``sync`` for real; after
``STEPS`` steps rank 0 predicts sync's whole time (the job's start-up, from
``--plan-probe-since`` to its first step, plus every step at the probe's warm speed) and
allows planning a tenth of it (:data:`PLAN_SHARE`). Where that tenth holds a session's
start-up (about this job's own) and the plan's cheapest trial (local SGD with its first
period of :data:`FIRST_PERIOD` steps, priced by the one cost model,
:mod:`shoal.strategies.cost`, on the link the probe's own sync steps measured), the run
stops there, checkpointed, and auto plans from that checkpoint; otherwise it goes on as the
sync run it already is. Either way the probe's steps are the run's own. Rank 0 writes the
decision to ``probe.json`` in ``--out`` and says it in one line; every rank learns it from
rank 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import detect_environment
from shoal.core.timeline import Timeline, comm_fraction
from shoal.strategies.cost import fitted_link, pattern_of, step_cost
from shoal.train.records import write_json

log = logging.getLogger("shoal.train")

#: The share of sync's predicted time that planning may take (Omnivore's overhead).
PLAN_SHARE = 0.10
#: A trial's default length: a tenth of the run's epochs, at most this many steps (Omnivore's
#: trials are short slices of a run, whatever its data's size).
TRIAL_STEPS = 100
#: The probe's first steps are warm-up (a first step builds buffers and buckets): untimed.
WARM_STEPS = 2
#: The planner's first step toward asynchrony (``shoal.plan.search.TAUS[0]``): the cheapest
#: trial a plan runs exchanges once in this many steps.
FIRST_PERIOD = 4
#: What ``probe.json`` is called in ``--out``.
PROBE_FILE = "probe.json"


def trial_epochs(epochs: float, steps_per_epoch: int, given: float | None = None) -> float:
    """A planning trial's epochs: ``given`` (``--trial-epochs``), else a tenth of the run's
    ``epochs``, at most :data:`TRIAL_STEPS` steps."""
    return given or min(epochs / 10, TRIAL_STEPS / steps_per_epoch)


@dataclass
class Verdict:
    """What the probe measured and decided (``probe.json``)."""

    steps: int  #: the run's step where it decided
    step_s: float  #: seconds a warm sync step takes
    comm_fraction: float  #: of which communicating
    startup_s: float  #: the job's start-up, until its first step
    predicted_s: float  #: sync's whole run: start-up and every step
    budget_s: float  #: a tenth of it
    needed_s: float  #: what planning costs at least: a session's start-up and its first trial
    plans: bool  #: whether the run stops here for planning
    why: str  #: the decision in a line


class Probe:
    """The decision of a run started with ``--plan-probe steps`` (rank 0 decides, at the
    ``steps``-th step of this invocation; every rank calls :meth:`stops` after each step)."""

    def __init__(self, steps: int, total_steps: int, trial_steps: int, comm: Comm,
                 out: Path, since: float, in_job: bool = False) -> None:
        self.steps, self.total, self.trial_steps = steps, total_steps, trial_steps
        self.comm, self.out = comm, out
        self.since = since  # when the run's launch began (UNIX time)
        #: The plan runs on this job's ranks (an outside launcher's job): no session to start.
        self.in_job = in_job
        self.startup_s = 0.0  # until its first step
        self._first: int | None = None  # this invocation's first step
        self._warm: float | None = None  # when the warm-up ended
        self._times: dict[str, float] = {}  # the timeline's totals then

    @classmethod
    def of(cls, cfg: TrainConfig, steps_per_epoch: int, comm: Comm) -> Probe | None:
        """The probe of a run with ``--plan-probe`` (``None`` without)."""
        if cfg.plan_probe is None:
            return None
        trial = max(4, round(trial_epochs(cfg.epochs, steps_per_epoch, cfg.trial_epochs)
                             * steps_per_epoch))
        since = cfg.plan_probe_since if cfg.plan_probe_since is not None else time.time()
        env = detect_environment()
        in_job = env is not None and env.launcher not in ("none", "local")
        return cls(cfg.plan_probe, cfg.epochs * steps_per_epoch, trial, comm, Path(cfg.out), since,
                   in_job)

    def stops(self, step: int) -> bool:
        """After ``step``: whether the run stops here for planning (decided once)."""
        if self._first is None:
            self._first = step - 1
            self.startup_s = max(0.0, time.time() - self.since)
        done = step - self._first
        if done == WARM_STEPS:
            self._warm, self._times = time.perf_counter(), self.comm.timeline.snapshot()
        if done != self.steps:
            return False
        verdict = self._decide(step) if self.comm.rank == 0 else None
        verdict = self.comm.broadcast_object(verdict) if self.comm.world_size > 1 else verdict
        return bool(verdict.plans)

    def _decide(self, step: int) -> Verdict:
        assert self._warm is not None and self._first is not None
        step_s = (time.perf_counter() - self._warm) / (self.steps - WARM_STEPS)
        share = comm_fraction(Timeline.delta(self.comm.timeline.snapshot(), self._times))
        predicted = self.startup_s + (self.total - self._first) * step_s
        budget = PLAN_SHARE * predicted
        trial_s = self.trial_steps * cheapest_step_s(step_s, share, self.comm.world_size)
        needed = (0.0 if self.in_job else self.startup_s) + trial_s
        plans = step < self.total and budget >= needed
        why = (f"sync's first {self.steps} steps predict {predicted:.0f} s for the run; "
               + (f"planning for a tenth of it ({budget:.0f} s)" if plans else
                  f"a tenth of it ({budget:.1f} s) holds no "
                  + ("" if self.in_job else "planning session's start-up and ")
                  + f"first trial ({needed:.1f} s): planning skipped, sync goes on"))
        verdict = Verdict(step, step_s, share, self.startup_s, predicted, budget, needed, plans,
                          why)
        write_json(self.out / PROBE_FILE, asdict(verdict))
        log.info(f"shoal: {why}")
        return verdict


def cheapest_step_s(step_s: float, share: float, workers: int) -> float:
    """A step of the plan's cheapest trial (local SGD exchanging every :data:`FIRST_PERIOD`
    steps) from sync's measured ``step_s`` and its communicating ``share``: the cost model's
    step on the link where sync's own pattern communicated that much."""
    sync, cheapest = pattern_of("sync", {}, workers), pattern_of("local-sgd",
                                                                {"tau": FIRST_PERIOD}, workers)
    if sync is None or cheapest is None:
        return step_s
    link = fitted_link(sync, workers, step_s * share)
    return step_cost(cheapest, workers, step_s * (1 - share), 1.0, link).step_s


def read_verdict(out: Path, since: float) -> dict[str, Any] | None:
    """The probe's decision in ``out``, written at or after ``since`` (a UNIX time; ``None``:
    the run did not get to it, and an older file is an earlier run's)."""
    from shoal.core.files import read_json

    path = out / PROBE_FILE
    if not path.is_file() or path.stat().st_mtime < since:
        return None
    return read_json(path, "probe's decision")
