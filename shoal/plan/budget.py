"""``--plan-budget auto``: planning's budget follows the run it plans.

``shoal train --strategy auto`` times sync's first steps in the run itself
(:mod:`shoal.train.probe`) and plans, from there, for a tenth of sync's predicted time
(:data:`~shoal.train.probe.PLAN_SHARE`), or not at all; the probe's steps are then sync's
trial in the job's layout (:func:`probe_trial`). ``shoal plan``, which has no run to probe,
takes the tenth from its first trial, sync's (:func:`auto_budget`).
"""

from __future__ import annotations

import math
from typing import Any

from shoal.plan.search import Candidate, Trial
from shoal.train.probe import PLAN_SHARE


def auto_budget(first: Trial, epochs: float) -> tuple[float, str]:
    """The budget after the plan's ``first`` trial (sync in the job's layout): a tenth of its
    start-up and ``epochs`` at its speed; that trial alone where it did not measure sync.
    Also the line that says so."""
    if not (first.ok and first.candidate.strategy == "sync" and math.isfinite(first.epoch_s)):
        return first.cost_s, "sync's trial measured no speed: planning stops after it"
    predicted = first.startup_s + epochs * first.epoch_s
    budget = PLAN_SHARE * predicted
    return budget, (f"sync's trial predicts {predicted:.0f} s for the run: planning for a "
                    f"tenth of it ({budget:.0f} s)")


def probe_trial(probe: dict[str, Any], sync: Candidate, steps_per_epoch: int) -> Trial:
    """The probe's steps (its ``probe.json``) as the speed-only trial of ``sync`` (in the
    job's layout)."""
    step_s = float(probe["step_s"])
    return Trial(sync, epoch_s=step_s * steps_per_epoch, cost_s=step_s * int(probe["steps"]),
                 speed_only=True, comm_fraction=float(probe["comm_fraction"]))
