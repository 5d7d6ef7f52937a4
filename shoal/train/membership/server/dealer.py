"""Server 0's side of an asynchronous job under ``--elastic``: who trains what, and who joins.

:class:`Dealer` keeps every worker's :class:`~shoal.train.membership.schedule.Schedule` as the workers do
(they report each share they take and each part they give before they act on it), deals a
lost worker's rest over the live ones, and releases the workers once all are idle.

**A worker joins** (``shoal join OUT``; :class:`JoinDesk` answers between the coordinator's
reports): server 0 checks its proof and the bound (``--max-workers``), serves it as a new
client of its shard and publishes a *give* deal naming the live workers. At its next look
each gives the joiner the last ``1/(n+1)`` of the rest of every block of its schedule from
where it is (:meth:`Schedule.give`: it reports where first, so server 0 cuts its copy at the
same place); once every giver gave or was lost, server 0 deals the pieces to the joiner. The
joiner starts from the center as its first pull has it (its state from the live server, not
from disk), at the epoch the records are at, and walks its pieces epoch by epoch; the
epochs before it are recorded without it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from shoal.core.waits import publish_members
from shoal.train.membership.changes import MembershipChange, epoch_span, joined_change, membership_change
from shoal.train.membership.handover import digest
from shoal.train.membership.messages import Adopt, Give, Idle, ReportKind
from shoal.train.membership.samples import record_since, samples_file, say_held
from shoal.train.membership.schedule import Schedule, Segment, cut, deal, length, slots_of
from shoal.train.membership.tracker.deals import DEALS, RELEASE, deal_key

log = logging.getLogger("shoal.membership")


class Dealer:
    """Server 0's side: every worker's schedule (as it adopts shares and gives parts), a
    lost worker's rest dealt over the live ones, a joiner's share taken from them, and the
    release once all are idle."""

    def __init__(self, cfg: Any, store: Any, n: int, workers: int, servers: int,
                 groups: tuple[tuple[int, int], ...] = ()) -> None:
        self.store, self.cfg, self.servers, self.workers = store, cfg, servers, workers
        self.slots = slots_of(cfg, n, workers)
        # A compute group (``groups``) walks one schedule, its first worker's: its members'
        # shards; the other members have none of their own (they are never dealt to).
        self.groups = groups  # the compute groups' layout (a checkpoint holds it)
        groups = groups or tuple((w, w + 1) for w in range(workers))
        self.schedules = {w: Schedule.empty(cfg.epochs) for w in range(workers)}
        for first, end in groups:
            self.schedules[first] = Schedule(self.slots, first, cfg.epochs, end - first)
        self.leads = {first for first, _ in groups}
        self.deals: list[dict[int, list[Segment]]] = []
        self.adopted: dict[int, set[int]] = {w: set() for w in range(workers)}
        self.idle: dict[int, int] = {}  # worker -> deals it had read when it said idle
        self.changes: list[MembershipChange] = []
        self.giving: dict[int, dict[str, Any]] = {}  # give deal -> its joiner, givers, pieces
        self.gone: set[int] = set()  # workers lost
        self.lost_at: dict[int, int] = {}  # a lost worker -> its last count
        #: compute groups: a leader -> the leaders its group lost before it; a lost leader
        #: whose place is not taken yet; where a new leader's records start (its group's count)
        self.former: dict[int, tuple[int, ...]] = {}
        self.orphans: set[int] = set()
        self.base: dict[int, int] = {}
        self.undealt: list[Segment] = []  # lost while every group alive was an orphan
        self.released = False
        self.stopping = False  # the workers were told to stop (SIGTERM here)
        self._takes: dict[ReportKind, Callable[[int, Any], None]] = {
            ReportKind.ADOPT: self._adopt, ReportKind.GIVE: self._give, ReportKind.IDLE: self._idle}

    def units(self, live: set[int]) -> list[int]:
        """The ``live`` workers that walk a schedule of their own, in order: each compute
        group's first, every joiner (it computes alone). Only they are dealt to or give."""
        return sorted(w for w in live if w in self.leads or w >= self.workers)

    def unit_of(self, worker: int) -> int:
        """The worker whose schedule ``worker`` walks: its compute group's first."""
        return worker if worker >= self.workers else max(u for u in self.leads if u <= worker)

    def resume(self, starts: dict[int, Any], changes: list[MembershipChange]) -> None:
        """Go on from a checkpoint (:func:`~shoal.train.membership.resume.rebuild`'s ``starts``,
        every worker's schedule as it rebuilt it) with its membership ``changes``."""
        self.schedules = {w: s.schedule for w, s in starts.items()}
        self.adopted = {w: set() for w in starts}
        self.changes = list(changes)

    def take(self, worker: int, report: Adopt | Give | Idle) -> None:
        """A worker's share taken, part given, or wait for its release."""
        self._takes[report.KIND](worker, report)

    def _adopt(self, worker: int, report: Adopt) -> None:
        self.schedules[worker].adopt(report.epoch, report.offset, self._shares(report.deal, worker))
        self.adopted[worker].add(report.deal)
        self.idle.pop(worker, None)

    def _give(self, worker: int, report: Give) -> None:
        give = self.giving[report.deal]
        give["pieces"] += self.schedules[worker].give(report.epoch, report.offset, give["parts"])
        give["waiting"].discard(worker)

    def _idle(self, worker: int, report: Idle) -> None:
        self.idle[worker] = report.deals

    def _publish(self, shares: dict[int, list[Segment]], live: set[int], **more: Any) -> int:
        """Deal ``shares`` (and what ``more`` says) to the workers; its number."""
        self.deals.append(shares)
        self.store.set(deal_key(len(self.deals)), json.dumps(
            {**more, "shares": {str(w): s for w, s in shares.items()}}))
        self.store.add(DEALS, 1)
        publish_members(self.store, f"async{len(self.deals)}",
                        [*range(self.servers), *(self.servers + w for w in sorted(live))])
        return len(self.deals)

    def lost(self, worker: int, info: dict[str, Any], live: set[int], why: Callable[[], str]
             ) -> int:
        """Deal what ``worker`` left (after its ``info["counted"]`` samples, and the shares
        it never took) over ``live``; the samples dealt. A compute group that has members
        alive goes on (a lost leader's place taken by the next, :meth:`lead`): its rest is
        dealt once its last member is lost, from the group's last count."""
        counted = self.lost_at[worker] = int(info.get("counted", 0))
        self.gone.add(worker)
        self.record_counted(worker, counted)
        self.idle.pop(worker, None)
        unit = self.unit_of(worker)
        goes_on = self.heirs(unit, live)
        if goes_on and worker == unit:  # its place is the next member's
            self.orphans.add(unit)
        elif not goes_on:
            self.orphans.discard(unit)
        rest = [] if goes_on else self._rest(unit)
        dealt = length(rest)
        units = self.units(live)
        if not units and not self.orphans:
            return 0
        if units and not self.released:
            self._publish(deal(rest, units), live, lost=worker)
        elif not units:  # every group alive has lost its leader: its heir takes it (lead)
            self.undealt += rest
        # nothing to deal (its group goes on): where its group is, else the end
        at = info.get("group_at", counted if goes_on else None)
        epochs = [e for e, _, _, _ in rest] or [
            self.cfg.epochs - 1 if at is None else self.schedules[unit].epoch_at(int(at))]
        note = " (no samples left)" if not goes_on else \
            f" (its compute group goes on without it, led by worker {unit})" if unit != worker \
            else f" (worker {goes_on[0]} takes its place in its compute group, unless it was " \
                 "lost in its exchange)"
        self.changes.append(membership_change(int(info.get("step", 0)), min(epochs),
                                              {worker: why()}, len(live), dealt,
                                              last=max(epochs), note=note))
        self.given(live)  # a give that waited for it
        return dealt

    def heirs(self, unit: int, live: set[int]) -> list[int]:
        """The ``live`` members of the compute group ``unit`` leads (or led), in order."""
        return sorted(w for w in live if w < self.workers and self.unit_of(w) == unit)

    def _shares(self, n: int, unit: int) -> list[Segment]:
        """Deal ``n``'s shares to ``unit``, and to the leaders its compute group lost."""
        return [s for u in (unit, *self.former.get(unit, ())) for s in self.deals[n - 1].get(u, [])]

    def _rest(self, unit: int) -> list[Segment]:
        """What ``unit`` (lost, and its group with it) left: its schedule's rest from its
        last count, and the shares it never took."""
        rest = self.schedules[unit].rest(self.lost_at[unit])
        for n in range(1, len(self.deals) + 1):
            if n not in self.adopted[unit]:
                rest += self._shares(n, unit)
        return rest

    def lead(self, new: int, old: int, acts: Sequence[Adopt | Give], live: set[int]) -> None:
        """``new`` takes lost ``old``'s place as its compute group's leader: the group's
        schedule is its, with the ``acts`` (the group's shares taken and parts given, in
        order) that ``old`` had not told, and so are the gives asked of ``old``; what was
        lost while no group had a leader is dealt over ``live``'s units now."""
        self.schedules[new], self.adopted[new] = self.schedules[old], self.adopted[old]
        self.former[new] = (*self.former.get(old, ()), old)
        self.leads.add(new)
        self.orphans.discard(old)
        self.base[new] = self.lost_at[old]
        for give in self.giving.values():
            if old in give["waiting"]:
                give["waiting"].discard(old)
                give["waiting"].add(new)
        for act in acts:
            if (act.KIND == ReportKind.ADOPT and act.deal not in self.adopted[new]) or (
                    act.KIND == ReportKind.GIVE
                    and new in self.giving.get(act.deal, {}).get("waiting", ())):
                self.take(new, act)
        for i, change in enumerate(self.changes):
            if not change.joined and change.ids == (old,):
                self.changes[i] = replace(change, group_led_by=new)
        if self.undealt and not self.released:
            self._publish(deal(self.undealt, self.units(live)), live, lost=old)
        self.undealt = []

    def admit(self, joiner: int, live: set[int], step: int, epoch: int) -> None:
        """``joiner`` joins at ``step`` (the furthest worker's) and the records' ``epoch``
        (from 0): ask ``live``'s :meth:`units` (without it) to give it its part."""
        self.schedules[joiner] = Schedule.empty(self.cfg.epochs)
        self.adopted[joiner] = set()
        self.changes.append(joined_change(step, epoch, [joiner], len(live) + 1, 0))
        givers = self.units(live)
        n = self._publish({}, live | {joiner}, give={"joiner": joiner, "parts": len(givers) + 1,
                                                     "givers": givers})
        self.giving[n] = {"joiner": joiner, "parts": len(givers) + 1, "waiting": set(givers),
                          "pieces": [], "change": len(self.changes) - 1}  # its change's index
        self.given(live | {joiner})

    def given(self, live: set[int]) -> None:
        """Deal each give whose givers all gave (or were lost) to its joiner, or over
        ``live`` when the joiner was lost meanwhile."""
        for n, give in list(self.giving.items()):
            if give["waiting"] - (self.gone - self.orphans):  # an orphan's: its heir gives
                continue
            del self.giving[n]
            joiner, pieces, at = give["joiner"], give["pieces"], give["change"]
            change = self.changes[at] = replace(self.changes[at],
                                                samples_dealt_again=length(pieces))
            if joiner not in self.gone:
                self._publish({joiner: pieces}, live, joined=joiner)
                epochs = [e for e, _, _, _ in pieces]
                of = epoch_span(min(epochs), max(epochs)) if epochs else "no epoch"
                log.info(f"shoal: worker {joiner} joined at step {change.step}; "
                         f"{len(live)} go on, worker {joiner} with the "
                         f"{change.samples_dealt_again} samples given it of {of}")
            elif pieces and self.units(live) and not self.released:
                self._publish(deal(pieces, self.units(live)), live, lost=joiner)

    def digests(self, joiner: int, server: torch.Tensor | None, mine: str | None) -> None:
        """The join's record: the center ``server`` sent ``joiner`` at its first pull, and
        the digest ``mine`` of the model it built from it."""
        for i, change in enumerate(self.changes):
            if not change.joined or change.ids != (joiner,):
                continue
            if mine is None:  # hogwild's: the joiner maps the shared parameters themselves
                self.changes[i] = replace(change, state="the shared parameters, mapped")
            else:
                self.changes[i] = replace(
                    change, state_sha256=digest({"center": server, "progress": {}}),
                    joiner_state_sha256={str(joiner): mine})

    def record_counted(self, worker: int, counted: int) -> None:
        """``--record-samples``: ``worker``'s samples up to its last count that server 0
        applied, written for it unless it wrote them (lost after the push, before its line)."""
        path = samples_file(self.cfg, worker)
        if path is None or counted <= 0:
            return
        walk = [s for block in self.schedules[worker].blocks for s in block]

        def since(last: int) -> dict[int, torch.Tensor]:  # a new leader's from its group's count
            last = max(last, self.base.get(worker, 0))
            samples, epochs = self.slots.samples(cut(cut(walk, counted)[0], last)[1])
            return {e: samples[epochs == e] for e in sorted(epochs.unique().tolist())}

        if not record_since(path, counted, since, "server 0", wait=self.cfg.heartbeat_timeout):
            say_held(worker, "its last count")

    def stop(self, live: set[int]) -> None:
        """Tell every worker to stop as SIGTERM would (a deal that says so, once): server 0
        was asked to stop, and a worker that joined (``shoal join``), which the launcher's
        SIGTERM does not reach, must stop with the job instead of training on alone."""
        if not self.stopping:
            self._publish({}, live, stop=True)
            self.stopping = True

    def release(self, live: set[int]) -> None:
        """Release the workers once every live one is idle with every deal read."""
        if not self.released and live and not self.giving and \
                all(self.idle.get(w) == len(self.deals) for w in live):
            self.store.set(RELEASE, "1")
            self.released = True


__all__ = ["Dealer"]
