"""summary.json's records of membership changes: a worker left, joined, or the run was
resumed on another number of workers; each printed as one line too.

A change is a :class:`MembershipChange`, made here only (:func:`membership_change`,
:func:`joined_change`, :func:`resumed_change`, or read back from a checkpoint with
:meth:`MembershipChange.of_record`); its :meth:`~MembershipChange.record` is what the summary
and the checkpoints hold."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("shoal.membership")

#: A change's facts added once known, in the order its record lists them.
LATER = ("group_led_by", "state", "state_sha256", "joiner_state_sha256", "stall_s")


@dataclass(frozen=True)
class MembershipChange:
    """Workers ``ids`` left (or ``joined``) at ``step`` of ``epoch`` (from 1), each for its
    reason in ``why``; ``workers`` go on with ``samples_dealt_again`` samples dealt anew.
    Added once known: a compute group's new leader (``group_led_by``), the state a joiner
    started from (``state`` in words, or its digest ``state_sha256`` and the joiners'
    ``joiner_state_sha256``) and the members' stall of a join (``stall_s``)."""

    step: int
    epoch: int
    ids: tuple[int, ...]
    why: dict[int, str]
    workers: int
    samples_dealt_again: int
    joined: bool = False
    group_led_by: int | None = None
    state: str | None = None
    state_sha256: str | None = None
    joiner_state_sha256: dict[str, str] | None = None
    stall_s: float | None = None

    def record(self) -> dict[str, Any]:
        """Its record, as summary.json and the checkpoints hold it."""
        later = {"group_led_by": self.group_led_by, "state": self.state,
                 "state_sha256": self.state_sha256,
                 "joiner_state_sha256": self.joiner_state_sha256, "stall_s": self.stall_s}
        return {"step": self.step, "epoch": self.epoch,
                "joined" if self.joined else "left": list(self.ids), "why": dict(self.why),
                "workers": self.workers, "samples_dealt_again": self.samples_dealt_again,
                **{k: v for k, v in later.items() if v is not None}}

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> MembershipChange:
        """The change whose :meth:`record` is ``record`` (a checkpoint's)."""
        joined = "joined" in record
        return cls(int(record["step"]), int(record["epoch"]),
                   tuple(int(w) for w in record["joined" if joined else "left"]),
                   {int(w): str(why) for w, why in record["why"].items()},
                   int(record["workers"]), int(record["samples_dealt_again"]), joined,
                   **{k: record[k] for k in LATER if k in record})


def records(changes: Sequence[MembershipChange] | None) -> list[dict[str, Any]]:
    """The records of ``changes`` (none: ``[]``)."""
    return [c.record() for c in changes or ()]


def of_records(saved: Sequence[dict[str, Any]] | None) -> list[MembershipChange]:
    """The changes a checkpoint's ``saved`` records list."""
    return [MembershipChange.of_record(r) for r in saved or ()]


def membership_change(step: int, epoch: int, why: dict[int, str], workers: int, dealt: int,
                      say: bool = True, last: int | None = None,
                      note: str = " (no samples left)") -> MembershipChange:
    """The change of workers ``why`` names (id -> reason) leaving at ``step`` of ``epoch``
    (from 0), ``workers`` going on with ``dealt`` samples dealt again (of epochs ``epoch``
    to ``last``, where later ones are dealt too); ``say``: print its line too, ending in
    ``note`` when nothing is dealt."""
    lost = sorted(why)
    if say:
        span = epoch_span(epoch, epoch if last is None else last)
        rest = f" with the {dealt} samples left of {span}" if dealt else note
        log.warning(f"shoal: {worker_names(lost)} left at step {step} ({'; '.join(why.values())}); "
                    f"{workers} go on{rest}")
    return MembershipChange(step, epoch + 1, tuple(lost), dict(why), workers, dealt)


def joined_change(step: int, epoch: int, ids: Sequence[int], workers: int, dealt: int,
                  why: str = "joined") -> MembershipChange:
    """The change of workers ``ids`` joining (or back, as ``why`` says) at ``step`` of
    ``epoch`` (from 0), ``workers`` going on with ``dealt`` samples dealt over them."""
    return MembershipChange(step, epoch + 1, tuple(ids), dict.fromkeys(ids, why), workers, dealt,
                            joined=True)


def epoch_span(first: int, last: int) -> str:
    """``epoch 3`` or ``epochs 3 to 5``, of epochs ``first`` to ``last`` counted from 0."""
    return f"epoch {first + 1}" if first == last else f"epochs {first + 1} to {last + 1}"


def worker_names(ids: list[int]) -> str:
    """``worker 2`` or ``workers 1, 3``."""
    return f"worker {ids[0]}" if len(ids) == 1 else "workers " + ", ".join(map(str, ids))


def resumed_change(saved_world: int, world: int, step: int, epoch: int, dealt: int,
                   say: bool) -> MembershipChange | None:
    """The change of a run resumed on ``world`` workers at ``step`` of ``epoch`` (from 0),
    ``dealt`` samples of it dealt over them; ``None`` on the checkpoint's number.
    ``say``: print its line too."""
    if world == saved_world:
        return None
    more = world > saved_world
    ids = list(range(min(world, saved_world), max(world, saved_world)))
    why = "started at --resume" if more else "not started at --resume"
    if say:
        log.info(f"shoal: resumed on {world} workers (the checkpoint's run had {saved_world}); "
                 f"{world} go on with the {dealt} samples left of epoch {epoch + 1}")
    if more:
        return joined_change(step, epoch, ids, world, dealt, why)
    return membership_change(step, epoch, dict.fromkeys(ids, why), world, dealt, say=False)


__all__ = ["MembershipChange", "epoch_span", "joined_change", "membership_change", "of_records",
           "records", "resumed_change", "worker_names"]
