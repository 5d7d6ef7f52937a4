"""A plan as a person reads it: the ranked table (``plan.md``, printed) and ``plan.png``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.plan.search import Plan, SearchSettings


def _time(v: float) -> str:
    return f"{v:.1f}" if math.isfinite(v) else "-"


def plan_table(plan: Plan, settings: SearchSettings) -> str:
    """The trials, best first: what each measured and predicts."""
    goal = f"{100 * settings.target:g}%"
    lines = [f"| rank | candidate | phase | s/epoch | test acc (epochs) | epochs to {goal} | "
             f"predicted s to {goal} |", "|---:|---|---|---:|---:|---:|---:|"]
    for i, t in enumerate(plan.trials, 1):
        if t.diverged or t.error:
            measured = "diverged" if t.diverged else "failed"
            lines.append(f"| {i} | {t.candidate.label()} | {t.phase} | {measured} | | | |")
            continue
        tested = f"{100 * t.accuracy:.1f}% ({t.curve[-1][0]:.3g})" if t.curve else "speed only"
        lines.append(f"| {i} | {t.candidate.label()} | {t.phase} | {t.epoch_s:.2f} | {tested} | "
                     f"{_epochs(t.predicted_epochs, settings.epochs)} | {_time(t.predicted_s)} |")
    for c, phase, why in plan.skipped:
        lines.append(f"| | {c.label()} | {phase} | skipped: {why} | | | |")
    return "\n".join(lines) + "\n"


def _epochs(predicted: float, epochs: float) -> str:
    """Predicted epochs; beyond the run's, only that (``> 15``)."""
    return f"> {epochs:g}" if predicted > epochs else _time(predicted)


def plan_figure(plan: Plan, settings: SearchSettings, path: Path) -> None:
    """Left: each trial's test accuracy against training time, the target dashed; right:
    the predicted time to the target of every trial that has one."""
    from shoal.plots import require_matplotlib

    plt = require_matplotlib()
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=80,
                                   gridspec_kw={"width_ratios": [3, 2]})
    ok = [t for t in plan.trials if t.ok]
    for i, t in enumerate(ok):
        ax.plot([p[2] for p in t.curve], [p[1] for p in t.curve], "o-", markersize=3,
                color=f"C{i % 10}", alpha=1.0 if i == 0 else 0.5,
                linewidth=2.5 if i == 0 else 1.0, label=t.candidate.label() if i < 8 else None)
    ax.axhline(settings.target, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("training time of the trial (s)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    if ok:  # (no trial trained: no curve to name)
        ax.legend(fontsize=7, loc="lower right")
    shown = [t for t in ok if math.isfinite(t.predicted_s)][:12]
    ys = list(range(len(shown)))
    bars.barh(ys, [t.predicted_s for t in shown], color=["C1" if i else "C0" for i in ys])
    bars.set_yticks(ys, [t.candidate.label() for t in shown], fontsize=7)
    bars.invert_yaxis()
    bars.set_xlabel(f"predicted training time to {100 * settings.target:g}% (s)")
    bars.grid(alpha=0.3, axis="x")
    fig.suptitle(f"shoal plan: {len(plan.trials)} trials in {plan.planning_s:.0f} s", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
