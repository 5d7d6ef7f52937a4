"""summary.json's records of membership changes: a worker left, joined, or the run was
resumed on another number of workers; each printed as one line too."""

from __future__ import annotations

import sys
from typing import Any


def membership_change(step: int, epoch: int, why: dict[int, str], workers: int, dealt: int,
                      say: bool = True, last: int | None = None,
                      note: str = " (no samples left)") -> dict[str, Any]:
    """summary.json's record of workers ``why`` names (id -> reason) leaving at ``step`` of
    ``epoch`` (from 0), ``workers`` going on with ``dealt`` samples dealt again (of epochs
    ``epoch`` to ``last``, where later ones are dealt too); ``say``: print its line too,
    ending in ``note`` when nothing is dealt."""
    lost = sorted(why)
    if say:
        span = epoch_span(epoch, epoch if last is None else last)
        rest = f" with the {dealt} samples left of {span}" if dealt else note
        print(f"shoal: {worker_names(lost)} left at step {step} ({'; '.join(why.values())}); "
              f"{workers} go on{rest}", file=sys.stderr, flush=True)
    return {"step": step, "epoch": epoch + 1, "left": lost, "why": why, "workers": workers,
            "samples_dealt_again": dealt}


def epoch_span(first: int, last: int) -> str:
    """``epoch 3`` or ``epochs 3 to 5``, of epochs ``first`` to ``last`` counted from 0."""
    return f"epoch {first + 1}" if first == last else f"epochs {first + 1} to {last + 1}"


def worker_names(ids: list[int]) -> str:
    """``worker 2`` or ``workers 1, 3``."""
    return f"worker {ids[0]}" if len(ids) == 1 else "workers " + ", ".join(map(str, ids))


def resumed_change(saved_world: int, world: int, step: int, epoch: int, dealt: int,
                   say: bool) -> dict[str, Any] | None:
    """summary.json's record of a run resumed on ``world`` workers at ``step`` of ``epoch``
    (from 0), ``dealt`` samples of it dealt over them; ``None`` on the checkpoint's number.
    ``say``: print its line too."""
    if world == saved_world:
        return None
    more = world > saved_world
    ids = list(range(min(world, saved_world), max(world, saved_world)))
    why = "started at --resume" if more else "not started at --resume"
    if say:
        print(f"shoal: resumed on {world} workers (the checkpoint's run had {saved_world}); "
              f"{world} go on with the {dealt} samples left of epoch {epoch + 1}",
              file=sys.stderr, flush=True)
    return {"step": step, "epoch": epoch + 1, "joined" if more else "left": ids,
            "why": dict.fromkeys(ids, why), "workers": world, "samples_dealt_again": dealt}


__all__ = ["epoch_span", "membership_change", "resumed_change", "worker_names"]
