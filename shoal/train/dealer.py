"""Server 0's side of an asynchronous job under ``--elastic``: who trains what, and who joins.

:class:`Dealer` keeps every worker's :class:`~shoal.train.deal.Schedule` as the workers do
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
import sys
from collections.abc import Callable
from typing import Any

import torch

from shoal.core.joining import BAD_PROOF, proved, worker_id
from shoal.core.stop import request_stop, stop_requested
from shoal.core.waits import ELASTIC, publish_members
from shoal.errors import ShoalError
from shoal.train.changes import epoch_span, membership_change
from shoal.train.deal import Schedule, Segment, cut, deal, length
from shoal.train.elastic_async import DEALS, RELEASE, deal_key, leave_key, slots_of
from shoal.train.handover import digest
from shoal.train.resume_async import dealer_state, rebuild, schedule_of
from shoal.train.samples import cut_upto, record_since, samples_file, say_held


class Dealer:
    """Server 0's side: every worker's schedule (as it adopts shares and gives parts), a
    lost worker's rest dealt over the live ones, a joiner's share taken from them, and the
    release once all are idle."""

    def __init__(self, cfg: Any, store: Any, n: int, workers: int, servers: int) -> None:
        self.store, self.cfg, self.servers = store, cfg, servers
        self.slots = slots_of(cfg, n, workers)
        self.schedules = {w: Schedule(self.slots, w, cfg.epochs) for w in range(workers)}
        self.deals: list[dict[int, list[Segment]]] = []
        self.adopted: dict[int, set[int]] = {w: set() for w in range(workers)}
        self.idle: dict[int, int] = {}  # worker -> deals it had read when it said idle
        self.changes: list[dict[str, Any]] = []
        self.giving: dict[int, dict[str, Any]] = {}  # give deal -> its joiner, givers, pieces
        self.gone: set[int] = set()  # workers lost
        self.lost_at: dict[int, int] = {}  # a lost worker -> its last count
        self.released = False
        self.stopping = False  # the workers were told to stop (SIGTERM here)

    def resume(self, starts: dict[int, Any], changes: list[dict[str, Any]]) -> None:
        """Go on from a checkpoint (:func:`~shoal.train.resume_async.rebuild`'s ``starts``,
        every worker's schedule as it rebuilt it) with its membership ``changes``."""
        self.schedules = {w: s.schedule for w, s in starts.items()}
        self.adopted = {w: set() for w in starts}
        self.changes = list(changes)

    def take(self, worker: int, report: dict[str, Any]) -> None:
        """A worker's ``adopt``, ``give`` or ``idle`` report."""
        kind = report["kind"]
        if kind == "adopt":
            n = int(report["deal"])
            self.schedules[worker].adopt(int(report["epoch"]), int(report["offset"]),
                                         self.deals[n - 1][worker])
            self.adopted[worker].add(n)
            self.idle.pop(worker, None)
        elif kind == "give":
            give = self.giving[int(report["deal"])]
            give["pieces"] += self.schedules[worker].give(
                int(report["epoch"]), int(report["offset"]), give["parts"])
            give["waiting"].discard(worker)
        else:
            self.idle[worker] = int(report["deals"])

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
        it never took) over ``live``; the samples dealt."""
        counted = self.lost_at[worker] = int(info.get("counted", 0))
        self.gone.add(worker)
        self.record_counted(worker, counted)
        rest = self.schedules[worker].rest(counted)
        for n, shares in enumerate(self.deals, 1):
            if n not in self.adopted[worker]:
                rest += shares.get(worker, [])
        dealt = length(rest)
        self.idle.pop(worker, None)
        if not live:
            return 0
        if not self.released:
            self._publish(deal(rest, sorted(live)), live, lost=worker)
        epochs = [e for e, _, _, _ in rest] or [self.cfg.epochs - 1]
        self.changes.append(membership_change(int(info.get("step", 0)), min(epochs),
                                              {worker: why()}, len(live), dealt,
                                              last=max(epochs)))
        self.given(live)  # a give that waited for it
        return dealt

    def admit(self, joiner: int, live: set[int], step: int, epoch: int) -> None:
        """``joiner`` joins at ``step`` (the furthest worker's) and the records' ``epoch``
        (from 0): ask ``live`` (without it) to give it its part."""
        self.schedules[joiner] = Schedule.empty(self.cfg.epochs)
        self.adopted[joiner] = set()
        change = {"step": step, "epoch": epoch + 1, "joined": [joiner],
                  "why": {joiner: "joined"}, "workers": len(live) + 1, "samples_dealt_again": 0}
        self.changes.append(change)
        n = self._publish({}, live | {joiner}, give={"joiner": joiner, "parts": len(live) + 1,
                                                     "givers": sorted(live)})
        self.giving[n] = {"joiner": joiner, "parts": len(live) + 1, "waiting": set(live),
                          "pieces": [], "change": change}
        self.given(live | {joiner})

    def given(self, live: set[int]) -> None:
        """Deal each give whose givers all gave (or were lost) to its joiner, or over
        ``live`` when the joiner was lost meanwhile."""
        for n, give in list(self.giving.items()):
            if give["waiting"] - self.gone:
                continue
            del self.giving[n]
            joiner, pieces = give["joiner"], give["pieces"]
            give["change"]["samples_dealt_again"] = length(pieces)
            if joiner not in self.gone:
                self._publish({joiner: pieces}, live, joined=joiner)
                epochs = [e for e, _, _, _ in pieces]
                of = epoch_span(min(epochs), max(epochs)) if epochs else "no epoch"
                print(f"shoal: worker {joiner} joined at step {give['change']['step']}; "
                      f"{len(live)} go on, worker {joiner} with the "
                      f"{give['change']['samples_dealt_again']} samples given it of {of}",
                      file=sys.stderr, flush=True)
            elif pieces and live and not self.released:
                self._publish(deal(pieces, sorted(live)), live, lost=joiner)

    def digests(self, joiner: int, server: torch.Tensor | None, mine: str | None) -> None:
        """The join's record: the center ``server`` sent ``joiner`` at its first pull, and
        the digest ``mine`` of the model it built from it."""
        for change in self.changes:
            if change.get("joined") != [joiner]:
                continue
            if mine is None:  # hogwild's: the joiner maps the shared parameters themselves
                change.update(state="the shared parameters, mapped")
            else:
                change.update(state_sha256=digest({"center": server, "progress": {}}),
                              joiner_state_sha256={str(joiner): mine})

    def record_counted(self, worker: int, counted: int) -> None:
        """``--record-samples``: ``worker``'s samples up to its last count that server 0
        applied, written for it unless it wrote them (lost after the push, before its line)."""
        path = samples_file(self.cfg, worker)
        if path is None or counted <= 0:
            return
        walk = [s for block in self.schedules[worker].blocks for s in block]

        def since(last: int) -> dict[int, torch.Tensor]:
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


class JoinDesk:
    """Server 0's answers to ``shoal join`` in an asynchronous ``--elastic`` job: each
    request (:mod:`shoal.core.joining`'s ticket and proof) checked and answered between
    the coordinator's reports, and a worker admitted through ``admit(joiner)``."""

    def __init__(self, store: Any, seal: Any, first: int, cap: int) -> None:
        import torch.distributed as dist

        self.keys = dist.PrefixStore(ELASTIC, store)
        self.seal, self.first, self.cap = seal, first, cap
        self.handled = 0

    def answer(self, live: int, ending: bool, admit: Callable[[int], int]) -> None:
        """Answer every request asked since the last look, the job having ``live``
        workers (``ending``: none has work left); ``admit(joiner)`` admits one and returns
        the epoch it starts at."""
        asked = int(self.keys.add("join/asked", 0))
        while self.handled < asked:
            self.handled += 1
            ticket, why = self.handled, None
            joiner = worker_id(self.first, ticket)
            if not proved(self.keys, self.seal, ticket):
                why = BAD_PROOF
            elif live >= self.cap:
                why = (f"the job has {live} workers, its most (--max-workers {self.cap}); a "
                       "worker may join once one is lost")
            elif ending:
                why = "the job is ending: no worker has work left to give it"
            reply: dict[str, Any] = {"refused": why}
            if why is None:
                try:
                    reply, live = {"epoch": admit(joiner), "joined": [joiner]}, live + 1
                except ShoalError as exc:  # a staleness bound that cannot take one more
                    reply = {"refused": str(exc)}
            self.keys.set(f"join/{ticket}/answer", json.dumps(reply))


class AsyncMembers:
    """The coordinator's ``--elastic`` side (``c``: the
    :class:`~shoal.train.coordinator.Coordinator`): its :class:`Dealer`, its
    :class:`JoinDesk` (where the job's join secret ``seal`` is known) and the epoch each
    joiner starts at."""

    def __init__(self, c: Any, seal: Any) -> None:
        self.c, store = c, c.comm.attempt_store
        self.dealer = Dealer(c.cfg, store, len(c.data.train), c.workers, c.servers)
        self.desk = JoinDesk(store, seal, c.workers, c.cfg.max_workers or c.workers) \
            if seal is not None and store is not None else None
        self.first_epoch: dict[int, int] = {}  # a joiner -> the epoch (from 0) it starts at
        #: how far into each worker's schedule its samples are in the records' count (its
        #: epochs reported; a lost worker's counted samples are added at its loss)
        self.accounted: dict[int, int] = {}
        self.leaving: set[int] = set()  #: workers that said they leave (SIGTERM to shoal join)

    def take(self, worker: int, report: dict[str, Any]) -> bool:
        """A report of this side's (``True``): a share taken, a part given, idle, joined."""
        kind = report["kind"]
        if kind == "epoch" and worker in self.dealer.schedules:
            done = self.dealer.schedules[worker].start(min(int(report["epoch"]), self.c.cfg.epochs))
            self.accounted[worker] = max(self.accounted.get(worker, 0), done)
        elif kind in ("adopt", "give", "idle"):
            self.dealer.take(worker, report)
        elif kind == "joined":
            mine = self.c.shard.first_pulls.pop(worker, None)
            if self.c.followers is not None:  # the other servers' shards of it
                mine = self.c.followers.first_pull(worker, mine)
            self.dealer.digests(worker, mine, report["digest"])
        elif kind == "leaving":  # SIGTERM to its shoal join: the last one stops the job
            self.leaving.add(worker)
            last = not self.c.live - self.c.finals.keys() - self.leaving
            if last:
                request_stop()
            self.c.comm.attempt_store.set(leave_key(worker), "stop" if last else "go")
        return kind in ("adopt", "give", "idle", "joined", "leaving")

    def due(self, epoch: int) -> set[int]:
        """The live workers epoch ``epoch`` (from 1) is recorded from: not those that
        joined after it began."""
        return {w for w in self.c.live if self.first_epoch.get(w, 0) < epoch}

    def lost(self, worker: int, info: dict[str, Any]) -> None:
        """What ``worker`` left dealt over the workers still training."""
        c = self.c

        def why() -> str:  # asked after the deal is out: the launcher's word may take a while
            status = c.ended(c.servers + worker) if c.ended is not None else None
            return f"worker {worker} {status}" if status else \
                f"worker {worker} stopped answering ({info.get('error', 'connection lost')})"

        c.own.pop(worker, None)  # its state is not one to resume: its rest was dealt
        # What its work carried into the center since its last epoch report is in no record
        # (its sums of that epoch are gone with it): the samples count it all the same. What
        # it reported past its count is dealt again and will be reported again: once only.
        counted = int(info.get("counted", 0))
        c.state.samples += counted - self.accounted.get(worker, 0)
        self.accounted[worker] = counted
        live = c.live - c.finals.keys()
        if not int(info.get("step", 0)):  # it never stepped (a joiner lost before its first
            info = {**info, "step": self._job_step(live)}  # exchange): the job's step
        dealt = self.dealer.lost(worker, info, live, why)
        c.recorder.notes["membership_changes"] = self.dealer.changes
        c.lost[worker].update(samples_trained=counted,
                              samples_not_trained=0, samples_dealt_again=dealt)

    def checkpoint(self, servers: list[dict[str, Any]], savers: dict[int, Any]
                   ) -> tuple[dict[str, Any], int]:
        """Server 0's part of a checkpoint whose workers' states are ``savers``' (their
        reports; :func:`~shoal.train.resume_async.dealer_state`); ``servers``: every server's
        state, whose least count of a worker is what of it counts (hogwild's: the shared
        file's). Each server's saved counts become where each worker goes on from, so that one
        lost after the resume before its first exchange leaves what it had not counted only.
        With it, the samples the file counts that no report carried yet: a worker with no
        state in it (a joiner) is not started again, its work to its count stands."""
        c, dealer = self.c, self.dealer

        def count(w: int) -> int:
            if c.counted_of is not None and c.followers is None:  # hogwild
                return int(c.counted_of(w, {})[0])
            return min(int(s.get("counted", {}).get(w, 0)) for s in servers)

        others = sorted(w for w in c.live if w not in savers and w not in dealer.gone)
        counts = {w: count(w) for w in others}
        going_on = {**dealer.lost_at, **counts,
                    **{w: int(r["own"]["elastic"]["at"]) for w, r in savers.items()}}
        for server in servers:
            server["counted"] = dict(going_on)
        unreported = sum(n - self.accounted.get(w, 0) for w, n in counts.items())
        return dealer_state(dealer, counts, dict(dealer.lost_at), max(dealer.schedules) + 1,
                            {**self.accounted, **counts},
                            {w: e for w, e in self.first_epoch.items() if w < c.workers}
                            ), unreported

    def resume(self, payload: dict[str, Any]) -> None:
        """Go on from ``payload``: every worker's schedule rebuilt, the workers lost before
        it back (a membership change) and the next joiner's id past every earlier one's."""
        c = self.c
        part = payload["coordinator"]["elastic"]
        for w, count in part["counts"].items():  # a joiner's samples to its count, unless
            if w >= c.workers:  # its file has them: it is not started again
                self.dealer.schedules[w] = schedule_of(part["schedules"][w])
                cut_upto(samples_file(c.cfg, w), int(count))  # its rest is dealt to others
                self.dealer.record_counted(w, int(count))
        starts = rebuild(payload, c.workers, self.dealer.slots, c.cfg.epochs)
        back = sorted(w for w, s in starts.items() if s.back)
        changes = list(part["changes"])
        if back:
            changes.append({
                "step": int(payload["progress"]["step"]),
                "epoch": min(starts[w].epoch for w in back) + 1, "joined": back,
                "why": dict.fromkeys(back, "back at --resume"), "workers": c.workers,
                "samples_dealt_again": sum(length(starts[w].schedule.rest(starts[w].position))
                                           for w in back)})
            given = changes[-1]["samples_dealt_again"]
            print(f"shoal: {'worker' if len(back) == 1 else 'workers'} "
                  f"{', '.join(map(str, back))} {'is' if len(back) == 1 else 'are'} back at "
                  f"--resume with the {given} samples given", file=sys.stderr, flush=True)
        self.dealer.resume(starts, changes)
        c.recorder.notes["membership_changes"] = changes
        self.accounted = {int(w): int(n) for w, n in part.get("accounted", {}).items()}
        # A worker back at an earlier resume may have started past epochs not recorded yet.
        self.first_epoch = {int(w): int(e) for w, e in part.get("first", {}).items()}
        for w in back:
            # to its count: in the records, or added when it was lost; its samples to it in
            # its file, unless the file has them (lost, and not seen so yet)
            self.accounted[w] = starts[w].position
            self.dealer.record_counted(w, starts[w].position)
            self.first_epoch[w] = starts[w].epoch
        if self.desk is not None:
            self.desk.first = int(part["next"])

    def tick(self) -> None:
        """Between reports: answer join requests, deal the gives complete, release."""
        c, dealer = self.c, self.dealer
        live = c.live - c.finals.keys()
        if self.desk is not None:
            ending = dealer.released or all(w in dealer.idle for w in live)
            self.desk.answer(len(live), ending, self._admit)
            live = c.live - c.finals.keys()
        dealer.given(live)
        if stop_requested():
            dealer.stop(live)
        dealer.release(live)

    def _job_step(self, live: set[int]) -> int:
        """The job's step: the furthest of the ``live`` workers' (where a join, or the loss
        of a worker that never stepped, stands in ``membership_changes``)."""
        return max((self.c.shard.steps.get(w, 0) for w in live), default=0)

    def _admit(self, joiner: int) -> int:
        """Serve ``joiner`` and ask the others for its part; the epoch it starts at."""
        c = self.c
        # It connects right after its answer (its data loaded already): a joiner lost before
        # it connects is lost within the heartbeat timeout, not --timeout. A staleness bound
        # that cannot take one more refuses it.
        wait = min(c.cfg.heartbeat_timeout, c.cfg.timeout)
        c.shard.add_client(joiner, wait)
        if c.followers is not None:  # served by every server before it is answered
            c.followers.tell("serve", joiner, connect_timeout=wait)
        self.first_epoch[joiner] = epoch = c.state.epoch
        live = c.live - c.finals.keys()  # its step: the furthest live worker's now
        self.dealer.admit(joiner, live, self._job_step(live), epoch)
        c.live.add(joiner)
        c.recorder.notes["membership_changes"] = self.dealer.changes
        return epoch


__all__ = ["AsyncMembers", "Dealer", "JoinDesk"]
