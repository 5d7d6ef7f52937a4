"""Where a resumed run goes on (``--resume``, ``--max-restarts``' restart).

**Workers that meet** (``sync``, the periodic strategies): a checkpoint holds the epoch's
plan as the run had it (:class:`SavedPlan`). After a membership change (``--elastic``) the
rest of the epoch was dealt anew, an order of its own, which the resumed run must go on
with, or it would train again what the plan before the change had already read and never
what the lost workers left. On another number of workers (``sync`` anywhere; the periodic
strategies from an epoch's end, :func:`~shoal.train.checkpoint.check_workers`) the rest of
the checkpoint's epoch is dealt over the workers there are now (:func:`go_on`), each with
its own batch (so the global batch follows the world, as after a change under
``--elastic``), and the schedule follows the share of the epochs trained; the change is
recorded like one.

**An asynchronous ``--elastic`` run**: every worker's schedule rebuilt from the checkpoint,
the same way on server 0 and on each worker.

Server 0's part of the checkpoint is its
:class:`~shoal.train.membership.server.dealer.Dealer` as it was (:func:`dealer_state`: every
worker's schedule as server 0 keeps it, the deals and who took which, the gives not handed
over yet, the lost workers' counts, the live joiners' counts); each worker's part says where
it was in its schedule (its block, the samples of it read, the samples that had counted).
The resumed job runs on the checkpoint's ``W`` workers again (:func:`rebuild`):

- a worker whose state is in the file goes on from its position, with its schedule and the
  shares dealt to it that it had not taken yet;
- what a worker not started again had left (a joiner: its schedule from its count, its
  shares not taken; pieces given for a joiner and not handed over yet) is dealt over all ``W``;
- a worker lost before the checkpoint is back: its schedule up to its last count (so its
  ``--record-samples`` file goes on), its share of the above, then a part of every other
  worker's rest, as a joiner is given one.

Server 0's copy of a schedule may have taken shares or given parts after the worker's
saved position (its reports came later); both happen only after a worker's position, so
the schedule up to it is the worker's own, and the copy is the one used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shoal.data import EpochPlan
from shoal.errors import ShoalError
from shoal.train.membership.changes import MembershipChange, of_records, records
from shoal.train.membership.schedule import Schedule, Segment, Slots, cut, deal, length


@dataclass
class SavedPlan:
    """A checkpoint's epoch plan (``order``: ``None`` for the epoch's own permutation) and
    the membership changes recorded so far."""

    order: torch.Tensor | None
    global_batch: int
    world: int
    changes: list[MembershipChange]

    @classmethod
    def of(cls, payload: dict[str, Any]) -> SavedPlan:
        """From a checkpoint (one written before plans were kept: the epoch's permutation
        over the checkpoint's ranks)."""
        return cls(payload.get("plan_order"), int(payload["global_batch"]),
                   int(payload.get("world_size", len(payload["ranks"]))),
                   of_records(payload.get("membership_changes")))


def go_on(saved: SavedPlan, n: int, global_batch: int, world: int, seed: int, epoch: int,
          epoch_step: int) -> tuple[EpochPlan, int] | None:
    """The plan the resumed epoch goes on with, and its step, on ``world`` workers with a
    ``global_batch``; ``None`` where the run's own plan of the epoch goes on (the epoch's
    start, or the same plan as the checkpoint's)."""
    if epoch_step == 0 and saved.order is None:
        return None
    plan = EpochPlan(n if saved.order is None else len(saved.order), saved.global_batch,
                     saved.world, seed, saved.order)
    if saved.world == world and saved.global_batch == global_batch:
        return None if saved.order is None else (plan, epoch_step)
    rest = plan.rest(plan.permutation(epoch), epoch_step)
    return EpochPlan(len(rest), global_batch, world, seed, rest), 0


@dataclass
class Start:
    """Where one worker of a resumed job starts."""

    schedule: Schedule
    epoch: int  #: the block (trainer epoch, from 0) it goes on in
    offset: int  #: samples of that block already read
    position: int  #: samples of its whole schedule read (its strategy's sample count)
    at: int  #: samples of its schedule whose work counted (its records')
    back: bool = False  #: lost before the checkpoint: started again, from the center


def dealer_state(dealer: Any, counts: dict[int, int], lost: dict[int, int], next_id: int,
                 accounted: dict[int, int] | None = None, first: dict[int, int] | None = None
                 ) -> dict[str, Any]:
    """Server 0's part: ``dealer``'s state; ``counts``: each live worker's count that has
    no state in the file (a joiner); ``lost``: each lost worker's last count; ``next_id``:
    the id the next joiner gets; ``accounted``: how far into each worker's schedule its
    samples are in the records' count; ``first``: the epoch (from 0) each worker back at an
    earlier ``--resume`` started at (it reports no epoch before it)."""
    return {"schedules": {w: s.blocks for w, s in dealer.schedules.items()},
            "deals": dealer.deals, "adopted": {w: sorted(n) for w, n in dealer.adopted.items()},
            "giving": [g["pieces"] for g in dealer.giving.values()],
            "counts": counts, "lost": lost, "changes": records(dealer.changes), "next": next_id,
            "accounted": accounted or {}, "first": first or {},
            "groups": [list(g) for g in dealer.groups]}


def _segments(raw: Any) -> list[Segment]:
    return [(int(e), int(w), int(lo), int(hi)) for e, w, lo, hi in raw]


def schedule_of(blocks: Any) -> Schedule:
    """A :class:`Schedule` of ``blocks`` as a checkpoint holds them."""
    schedule = Schedule.empty(len(blocks))
    schedule.blocks = [_segments(b) for b in blocks]
    return schedule


def _head(schedule: Schedule, count: int) -> Schedule:
    """``schedule`` with only its first ``count`` samples."""
    head = Schedule.empty(len(schedule.blocks))
    for e, block in enumerate(schedule.blocks):
        head.blocks[e], _ = cut(block, count)
        count -= length(head.blocks[e])
    return head


def positions_of(payload: dict[str, Any]) -> dict[int, dict[str, int]]:
    """Each worker's saved position (``epoch``, ``read``, ``at``) in ``payload``, by id: those
    whose state the checkpoint holds."""
    out = {}
    for w, own in enumerate(payload["ranks"]):
        if own is not None and own.get("elastic") is not None:
            out[w] = {k: int(v) for k, v in own["elastic"].items()}
    return out


def check(payload: dict[str, Any], elastic: bool) -> None:
    """One line where an asynchronous checkpoint cannot go on with or without ``--elastic``
    (nor, from an ``--elastic`` run of compute groups that lost or gained a worker, yet)."""
    part = (payload.get("coordinator") or {}).get("elastic")
    if elastic and part is not None and part.get("changes") and \
            any(end - first > 1 for first, end in part.get("groups", [])):
        raise ShoalError("the checkpoint is of an --elastic run of compute groups that lost or "
                         "gained workers, which does not resume yet (one that did not does); "
                         "start from it with --init-from instead")
    if elastic and part is None:
        raise ShoalError("--elastic resumes an asynchronous run only from a checkpoint of an "
                         "--elastic run (its shares dealt); start from this one with "
                         "--init-from instead")
    if not elastic and part is not None:
        raise ShoalError("the checkpoint is of an asynchronous --elastic run: resume it with "
                         "--elastic (its workers' shares were dealt)")


def _extend(schedule: Schedule, worker: int, slots: Slots, epochs: int, shards: int = 1
            ) -> Schedule:
    """``schedule`` to ``epochs`` blocks (``--epochs`` grew): each new epoch's blocks of a
    new :class:`Schedule` of ``worker`` and ``shards`` members (its own shard; a compute
    group's members'; a joiner's and a group member's: nothing), empty shards left out."""
    if worker >= len(slots.sizes):  # a joiner: it has no slot
        shards = 0
    new = Schedule(slots, worker, epochs, shards).blocks[len(schedule.blocks):]
    schedule.blocks += [[s for s in block if s[3] > s[2]] for block in new]
    return schedule


def rebuild(payload: dict[str, Any], workers: int, slots: Slots, epochs: int
            ) -> dict[int, Start]:
    """Every worker's :class:`Start` from the checkpoint ``payload`` of an asynchronous
    ``--elastic`` run, on its ``workers`` workers (``slots``: theirs), for ``epochs``."""
    part = payload["coordinator"]["elastic"]
    saved_schedules = {int(w): schedule_of(b) for w, b in part["schedules"].items()}
    # a compute group's schedule is its members' shards (``groups``: its first's), a
    # member's none of its own
    shards = {w: (end - first if w == first else 0) for first, end in part.get("groups", [])
              for w in range(first, end)}
    schedules = {w: _extend(schedule_of(s.blocks), w, slots, epochs, shards.get(w, 1))
                 for w, s in saved_schedules.items()}
    deals = [{int(w): _segments(s) for w, s in d.items()} for d in part["deals"]]
    adopted = {int(w): set(n) for w, n in part["adopted"].items()}

    def untaken(w: int) -> list[Segment]:
        return [s for n, d in enumerate(deals, 1) if n not in adopted.get(w, set())
                for s in d.get(w, [])]

    starts: dict[int, Start] = {}
    saved = positions_of(payload)
    left: list[Segment] = []
    for w, p in sorted(saved.items()):  # live, with its state in the file
        schedule, epoch, offset = schedules[w], p["epoch"], p["read"]
        if epoch >= epochs:  # it had ended: at the end of its last block
            epoch, offset = epochs - 1, length(schedule.blocks[-1])
            left += untaken(w)
        else:
            schedule.adopt(epoch, offset, untaken(w))
        starts[w] = Start(schedule, epoch, offset, schedule.start(epoch) + offset, p["at"])
    for w, count in sorted(part["counts"].items()):  # live, not started again: a joiner
        left += schedules[int(w)].rest(int(count)) + untaken(int(w))
    for pieces in part["giving"]:
        left += _segments(pieces)
    recorded = int(payload["coordinator"]["epoch"])
    back = [w for w in range(workers) if w not in starts]
    for w in back:
        # lost, or lost and not yet seen so when the file was written (its rest is left's)
        count = int(part["lost"].get(w, part["counts"].get(w, 0)))
        head = _head(saved_schedules[w], count)
        last = max((e for e, b in enumerate(head.blocks) if b), default=0)
        head = _extend(head, w, slots, epochs, shards.get(w, 1))
        epoch = min(max(last, recorded), epochs - 1)
        offset = count - head.start(epoch)
        starts[w] = Start(head, epoch, offset, count, count, back=True)
    # What is left goes to the workers that had not ended (one that had ended is given work
    # only when every worker had: it trains it in its last epoch, whose record then has its
    # sums of that work alone).
    going = sorted([w for w, p in saved.items() if p["epoch"] < epochs] + back) \
        or list(range(workers))
    for w, share in deal(left, going).items():
        s = starts[w]
        s.schedule.adopt(s.epoch, s.offset, share)
    savers = sorted(set(starts) - set(back))
    for j, w in enumerate(back, 1):  # a part of every other worker's rest, as a joiner's
        pieces = [p for v in savers for p in
                  starts[v].schedule.give(starts[v].epoch, starts[v].offset, len(savers) + j)]
        starts[w].schedule.adopt(starts[w].epoch, starts[w].offset, pieces)
    return starts


def uncounted(slots: Slots, start: Start) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (epochs, samples) ``start``'s worker read before its position and had not counted
    yet: its records' next lines once they count."""
    walk = [s for block in start.schedule.blocks for s in block]
    samples, epochs = slots.samples(cut(cut(walk, start.position)[0], start.at)[1])
    return [(epochs, samples)] if len(samples) else []


__all__ = ["SavedPlan", "Start", "check", "dealer_state", "go_on", "positions_of", "rebuild",
           "schedule_of", "uncounted"]
