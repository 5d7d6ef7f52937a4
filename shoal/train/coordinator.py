"""Server 0's records of an asynchronous run: the :class:`Coordinator`.

Workers never talk to each other, so server 0 keeps ``--out`` from what they report: their
sums at each epoch's end, their state at each checkpoint, their totals at the end.

- The run's clock starts once every live worker can train (``started``), as a synchronous
  run's after its ranks meet. With ``--eval-every-steps E`` the center is also tested each
  time the workers' sample counts (``progress`` reports) add up to E more global batches.
- An epoch's record is written once every live worker has reported that epoch.
- A checkpoint is written once every live worker has sent its state for the same step, and
  once more at the end when their last states are of different steps (after SIGTERM each
  stops at its own). Each worker's position is in its own part of the file, so a resumed
  worker goes on from exactly where it stopped; ``"progress"`` is the slowest live worker's;
  the coordinator's part holds its count of epochs recorded and the reports of workers that
  ran ahead, so that after ``--resume`` no epoch record is lost or written twice.
- A worker killed mid-run (its pairs break) is lost: the others go on without it (with
  ``--elastic`` they train what it left, workers may join, and the checkpoint holds who
  trains what: :mod:`shoal.train.membership.server.dealer`). A worker that fails with an error says so first
  (a ``failed`` report): the job ends, as the echo of that failure, not a lost worker.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.flat import FlatParams
from shoal.core.timeline import Timeline
from shoal.data import Dataset, EpochPlan, ShardLoader
from shoal.errors import JobError, ShoalError
from shoal.models import count_parameters
from shoal.ps import ServerClient, ShardServer, staleness_summary
from shoal.train.center import Center
from shoal.train.checkpoint import to_cpu
from shoal.train.checkpointer import write_checkpoint
from shoal.train.evaluation import Evaluator
from shoal.train.membership.messages import (
    CheckpointPart,
    EpochEnd,
    Failed,
    Final,
    Progress,
    Report,
    ReportKind,
    Started,
    Where,
    decode_report,
)
from shoal.train.membership.schedule import loss_record
from shoal.train.membership.server.followers import Leader
from shoal.train.membership.server.members import AsyncMembers
from shoal.train.recorder import Recorder
from shoal.train.records import coordinator_part, pending_reports, queued, records_position
from shoal.train.remote import CLOCK_KEY, COLLAPSED_KEY
from shoal.train.state import RunState
from shoal.train.stopping import run_reason

log = logging.getLogger("shoal.train")


class WorkerFailed(ShoalError):
    """A worker failed with an error (its own line is the job's): the coordinator ends."""

    #: The echo of the worker's failure, never reported as the cause.
    echo = True


class Coordinator:
    """Server 0's records of an asynchronous run, from its workers' reports, kept by the
    trainer's own components: an :class:`Evaluator` of the center, a :class:`Recorder`
    and :func:`write_checkpoint`.

    ``comm``: this process's (rank 0 of the workers, no peers: its timeline's totals are the
    workers' summed, its bytes theirs); ``client``: its end of the other servers (they hold
    the rest of the center), ``None`` with one server. ``payload``: the checkpoint a resumed
    run goes on with; ``start``: the one ``--init-from --init-progress`` goes on from; ``extra``:
    the summary's additions; ``ended(rank)``: how a lost worker's process ended (launcher's);
    ``groups``: the workers' compute groups (``--elastic``: each walks one schedule).
    """

    def __init__(self, cfg: TrainConfig, comm: Comm, data: Dataset, model: torch.nn.Module,
                 flat: FlatParams, client: ServerClient | None, ranges: list[tuple[int, int]],
                 payload: dict[str, Any] | None, start: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, ended: Any = None, seal: Any = None,
                 groups: tuple[tuple[int, int], ...] = ()) -> None:
        self.cfg, self.comm, self.data, self.model, self.flat = cfg, comm, data, model, flat
        self.client, self.ranges, self.workers = client, ranges, comm.world_size
        self.center = Center(flat, model, ranges, client)  # the center as it reads it
        self.servers, self.extra, self.ended = len(ranges), extra or {}, ended
        self.plan = EpochPlan(len(data.train), cfg.global_batch(self.workers), self.workers,
                              cfg.seed)
        # The center is tested on the whole test set (this Comm has no peers); its time is
        # the records' eval_s, not the workers' time split.
        self.evaluator = Evaluator(cfg, comm, ShardLoader(data, self.plan, 0),
                                   lambda x, y: (x, y), Timeline())
        self.recorder = Recorder(cfg, comm, self.plan, self.evaluator, classes=data.num_classes)
        self.state = RunState(comm, torch.Generator(), lr=cfg.base_lr(self.workers))
        self.reports: queue.Queue[tuple[int, Report]] = queue.Queue()
        self.live = set(range(self.workers))
        self.latest: dict[int, Where] = {}  # each worker's last report
        self.epochs: dict[int, dict[int, EpochEnd]] = {}  # epochs not yet recorded
        self.checkpoints: dict[int, dict[int, CheckpointPart]] = {}  # step -> reports
        self.last: dict[int, CheckpointPart] = {}  # each worker's last checkpoint report
        self.saved: dict[int, int] = {}  # the step of each worker's state in the file
        self.own: dict[int, Any] = {}  # each worker's state in the file
        self.finals: dict[int, Final] = {}
        self.lost: dict[int, dict[str, Any]] = {}
        self.test, self.saved_step, self.started_unix = (float("nan"), float("nan")), -1, time.time()
        #: --elastic: its side (a lost worker's rest dealt over the others, joiners admitted)
        self.members = AsyncMembers(self, seal, groups) if cfg.elastic else None
        #: ``(worker, info) -> [counted, step]``, a lost worker's count where server 0's
        #: own is not it (hogwild's shared file; with several servers, the least of theirs)
        self.counted_of: Callable[[int, dict[str, Any]], list[int]] | None = None
        self.followers: Leader | None = None  #: --elastic with several servers: their Leader
        self.progress: dict[str, Any] | None = None
        self.started: set[int] | None = set()  # workers that can train; None: clock started
        self.trained: dict[int, int] = {}  # each worker's samples, as it last said
        self.test_every = (cfg.eval_every_steps or 0) * self.plan.global_batch or None
        self.next_test = self.test_every or 0
        self.shard: ShardServer | None = None  # the shard served (run())
        self._handlers: dict[ReportKind, Callable[[int, Any], None]] = {
            ReportKind.STARTED: self._started, ReportKind.PROGRESS: self._progressed,
            ReportKind.EPOCH: self._epoch_ended, ReportKind.CHECKPOINT: self._checkpoint_part,
            ReportKind.FINAL: self._final, ReportKind.FAILED: self._failed}
        if payload is not None:
            self._resume(payload)
        elif start is not None:
            self._go_on_from(start)

    def _resume(self, payload: dict[str, Any]) -> None:
        """Go on where the checkpoint ``payload`` left the records: the epochs recorded,
        the reports of epochs still to record, each worker's state."""
        self.own = dict(enumerate(payload["ranks"]))
        self.saved_step = int(payload["progress"]["step"])
        saved = payload.get("coordinator")
        if saved is None:  # an older checkpoint: every worker at its step
            self._go_on_from(payload)
            return
        self.progress, self.epochs = records_position(saved, self.plan.steps_per_epoch)
        if self.members is not None and saved.get("elastic") is not None:
            self.members.resume(payload)

    def _go_on_from(self, source: dict[str, Any]) -> None:
        """The position of a checkpoint of every worker at one step (``--init-progress``): a
        mid-epoch checkpoint's samples of that epoch come back in the workers' epoch sums."""
        carried = sum(int(r["epoch_sums"][2]) for r in source["ranks"] if r is not None)
        self.progress = {**source["progress"],
                         "samples": source["progress"]["samples"] - carried}
        self.saved_step = self.progress["step"]

    def on_report(self, client: int, obj: object) -> None:
        """A worker's report (called on its serving thread): queued for :meth:`run`; an elastic
        worker's rest (``idle``) or return to work (``adopt``) told to the shard at once.

        Raises:
            BadReport: not a report this coordinator takes (the worker is told so).
        """
        report = decode_report(obj, elastic=self.members is not None)
        if self.members is not None and self.shard is not None:
            self.members.resting(client, report)
        self.reports.put((client, report))

    # -- the run --------------------------------------------------------------------------
    def run(self, shard: ShardServer) -> dict[str, Any]:
        """Record the run until every worker has finished or been lost; the summary."""
        st, rec = self.state, self.recorder
        self.shard = shard
        if self.progress is not None:
            st.load_state_dict({"progress": self.progress, "rank": None})
        st.start()
        rec.begin(st, self.data.describe())
        rec.start_epoch(st)
        while self.live - self.finals.keys():
            # The losses seen before the reports are read: a worker's last report (a
            # failure, its final totals) reaches the queue before its pairs break.
            lost = dict(shard.lost)
            for client, obj in queued(self.reports, 0.2):
                self._take(client, obj)
            self._note_lost(lost)
            if self.members is not None:
                self.members.tick()
        rec.end_steps()
        return self._finish(shard)

    def _take(self, worker: int, report: Report) -> None:
        """``worker``'s ``report``, by its kind's handler (--elastic's kinds: its members')."""
        if self.members is not None and self.members.take(worker, report):
            return
        self._handlers[report.KIND](worker, report)
        self._progress()

    # -- the handlers of the reports: one per kind ---------------------------------------------
    def _failed(self, worker: int, report: Failed) -> None:
        raise WorkerFailed(f"worker {worker} failed ({report.error}); the job ends")

    def _started(self, worker: int, report: Started) -> None:
        self.latest[worker] = report
        if self.started is not None:
            self.started.add(worker)

    def _progressed(self, worker: int, report: Progress) -> None:
        self.latest[worker] = report
        self.trained[worker] = report.trained
        self._test_by_samples()

    def _epoch_ended(self, worker: int, report: EpochEnd) -> None:
        self.latest[worker] = report
        if self.members is not None:
            self.members.epoch(worker, report)
        if report.epoch > self.state.epoch:  # else recorded already
            self.epochs.setdefault(report.epoch, {})[worker] = report

    def _checkpoint_part(self, worker: int, report: CheckpointPart) -> None:
        self.latest[worker] = self.last[worker] = report
        self.checkpoints.setdefault(report.step, {})[worker] = report
        for earlier in [s for s, r in self.checkpoints.items() if s < report.step and worker not in r]:
            del self.checkpoints[earlier]  # it never will send that step's: never complete

    def _final(self, worker: int, report: Final) -> None:
        self.latest[worker] = self.finals[worker] = report

    def _note_lost(self, lost: dict[int, dict[str, Any]]) -> None:
        """Workers whose pairs broke (killed, or silent past --timeout) leave the live set."""
        for worker, info in lost.items():
            if worker in self.live and worker not in self.finals:
                self.live.discard(worker)
                if self.counted_of is not None:
                    counted, step = self.counted_of(worker, info)
                    info = {**info, "counted": counted, "step": max(step, info.get("step", 0))}
                step = max(int(info.get("step", 0)),
                           self.latest[worker].step if worker in self.latest else 0)
                self.lost[worker] = loss_record(self.plan, len(self.data.train), self.cfg.epochs,
                                                (worker, self.servers + worker), step, info,
                                                self.started_unix)
                if self.members is not None:
                    self.members.lost(worker, info)
                else:
                    log.warning(f"shoal: lost worker {worker} at step {self.lost[worker]['step']} "
                                f"({info.get('error', 'connection lost')}); the others go on")
                self._progress()

    def _progress(self) -> None:
        """Write what the reports so far complete, in the order of their steps: an epoch's
        record before a checkpoint at its last step, a checkpoint before a later epoch's
        record (the file then says which epochs were recorded). The clock starts first,
        once every live worker can train."""
        if self.started is not None and self.live <= self.started:
            self.started = None
            self.state.start()
            if self.comm.store is not None:
                self.comm.store.set(CLOCK_KEY, "1")  # the workers go
        savers = self._placing(self.live)
        while self.live:
            epoch = self.state.epoch + 1
            due = self.members.due(epoch) if self.members is not None else self.live
            ready = due <= self.epochs.get(epoch, {}).keys()
            step = min((s for s, r in self.checkpoints.items() if savers and savers <= r.keys()),
                       default=None)
            if step is not None and (not ready or step < epoch * self.plan.steps_per_epoch):
                reports = self.checkpoints.pop(step)
                if step > self.saved_step:
                    self._checkpoint({w: r for w, r in reports.items() if w in savers})
            elif ready:
                self._epoch_record(epoch, self.epochs.pop(epoch))
            else:
                return

    def _placing(self, workers: Any) -> set[int]:
        """Whose reports place a checkpoint: the first ``--workers``' (a joiner's state is not
        kept); with none of them left, the joiners' (their rest dealt again at --resume)."""
        return {w for w in workers if w < self.workers} or set(workers)

    def _sum_workers(self, at: dict[int, EpochEnd] | None = None) -> None:
        """The recorder's comm and timeline hold the workers' totals, summed: as of the
        reports ``at`` (an epoch's, which may complete late, once a lost worker is noticed),
        else each worker's latest."""
        totals: Counter[str] = Counter()
        reports = {**self.latest, **(at or {})}.values()
        for report in reports:
            totals.update(report.times)
        tl = self.comm.timeline
        tl.carry_over({k: v - tl.totals.get(k, 0.0) for k, v in totals.items()})
        self.comm.bytes_sent = sum(r.bytes for r in reports)

    def _epoch_record(self, epoch: int, reports: dict[int, EpochEnd]) -> None:
        """Record epoch ``epoch`` from every live worker's report of it, as a trainer
        records its epochs: its sums and position, its test, its record."""
        st, rec = self.state, self.recorder
        sums = torch.tensor([r.sums for r in reports.values()], dtype=torch.float64).sum(0)
        rec.add(sums[0], sums[1], int(sums[2]))
        self._sum_workers(reports)
        step = max([st.step + 1, *(r.step for r in reports.values())])  # a resume cuts at it
        st.reported(step, self.plan.steps_per_epoch, int(sums[2]), reports[min(reports)].lr)
        rec.step(st, int(sums[2]))
        rec.end_steps()
        st.epoch_done()
        tested = st.epoch % self.cfg.eval_every == 0 or st.epoch == self.cfg.epochs
        if tested:
            self.test = self.evaluator.test(self._center_model(reports))
        rec.epoch(st, self.test if tested else (float("nan"), float("nan")))
        if rec.health.stop and self.comm.store is not None:
            self.comm.store.set(COLLAPSED_KEY, "1")  # every worker stops, at its own step
        if st.epoch < self.cfg.epochs:
            rec.start_epoch(st)

    def _test_by_samples(self) -> None:
        """``--eval-every-steps``: test the center once the workers' samples pass the next
        multiple of that many global batches, and record it at their sum."""
        trained = sum(self.trained.values())
        if self.test_every is None or trained < self.next_test or self.started is not None:
            return
        self.next_test = (trained // self.test_every + 1) * self.test_every
        self.recorder.evaluation(self.state, self.evaluator.test(self._center_model(None)),
                                 samples=trained)

    def _center_model(self, reports: dict[int, EpochEnd] | None) -> torch.nn.Module:
        """The model the run evaluates: the center, with the reporting workers' buffers."""
        return self.center.model_with(self.shard, [r.buffers for r in (reports or {}).values()
                                                   if r.buffers])

    # -- checkpoints ----------------------------------------------------------------------
    def _checkpoint(self, reports: dict[int, CheckpointPart]) -> None:
        """Write ``checkpoint.pt`` with each reporting worker's state (the others': their
        last), the centers and the records' position; the slowest worker's is the file's."""
        slowest = min(reports.values(), key=lambda r: (r.step, r.worker))
        self.saved.update({w: r.step for w, r in reports.items()})
        reports = {w: r for w, r in reports.items() if w < self.workers}  # a joiner's: not kept
        self.own.update({w: r.own for w, r in reports.items()})
        full = self.center.vector(self.shard)
        if not torch.isfinite(full).all():
            raise ShoalError(f"the center became non-finite by step {slowest.step}; checkpoint "
                             "not written, the last good one is kept (lower --lr?)")
        self.center.load(full)
        servers = [self.shard.state()] + [self.client.fetch_state(s) for s in range(1, self.servers)
                                          if self.client is not None]
        for server in servers:
            server.pop("first_pulls", None)  # the join records', not the run's
        dealt, unreported = self.members.checkpoint(servers, reports) if self.members else ({}, 0)
        center = to_cpu(self.model.state_dict())  # the evaluation model, saved once
        pending, gone = pending_reports(self.epochs, reports, self.members is not None)
        write_checkpoint(
            self.cfg, self.plan, progress=slowest.own["progress"],
            scheduler=slowest.own["scheduler"],
            ranks=[self.own.get(w) for w in range(self.workers)], evaluated=center,
            shared={"model": center, "servers": to_cpu(servers), "coordinator": coordinator_part(
                self.state, pending, self.state.samples + gone + unreported, dealt)})
        self.saved_step = slowest.step

    # -- the end --------------------------------------------------------------------------
    def _finish(self, shard: ShardServer) -> dict[str, Any]:
        st, rec = self.state, self.recorder
        if not self.finals:
            raise JobError("every worker was lost: "
                           + "; ".join(f"worker {w}: {r['error'] or 'connection lost'}"
                                       for w, r in sorted(self.lost.items())))
        finals = self.finals
        last = {w: self.last[w] for w in self._placing(finals) if w in self.last}
        if any(self.saved.get(w) != r.step for w, r in last.items()):
            self._checkpoint(last)  # stopped (SIGTERM) at different steps: their last states
        self._sum_workers()
        st.step = min(r.step for r in finals.values())  # the checkpoint's, as the file says
        stopped = any(r.stopped for r in finals.values())
        reason = run_reason([r.stopped_by for r in finals.values()], rec.health.collapsed)
        st.train_time_s = st.elapsed_s()
        if math.isnan(self.test[1]) and not stopped:
            self.test = self.evaluator.test(self._center_model(None))
        lanes = [r.trace for _, r in sorted(finals.items()) if r.trace]
        summary = rec.finish(st, stopped, reason, self.test, count_parameters(self.model),
                             {**self._extras(shard), **self.extra}, lanes)
        assert summary is not None
        return summary

    def _extras(self, shard: ShardServer) -> dict[str, Any]:
        """What an asynchronous run's summary adds: servers, staleness (every shard's),
        lost workers (and how their processes ended, where the launcher says)."""
        hists = [dict(shard.staleness)]
        if self.client is not None:
            hists += [self.client.fetch_state(s)["staleness"] for s in range(1, self.servers)]
        finals = self.finals.values()
        for worker, record in self.lost.items():
            status = self.ended(self.servers + worker) if self.ended is not None else None
            if status is not None:
                record["exit_status"] = status
        return {
            "device": ", ".join(sorted({r.device for r in finals})),
            "servers": self.servers,
            "staleness": staleness_summary(hists),
            "lost_workers": [self.lost[w] for w in sorted(self.lost)],
            "degraded": bool(self.lost) and self.members is None,
            **({"workers": len(self.live)} if self.members is not None else {}),
        }
