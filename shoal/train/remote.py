"""A detached worker's components: they report to the coordinator instead of writing.

An asynchronous job's workers never wait for each other, so none of them tests the model or
writes into ``--out``: the trainer of such a worker gets these versions of its evaluation,
records and checkpoints, which send what the real ones would use to server 0, the
coordinator, over the parameter-server client's report channel. The coordinator runs the
real components (:mod:`shoal.train.coordinator`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.data import EpochPlan, ShardLoader
from shoal.errors import ShoalError
from shoal.strategies.asynchronous import detached
from shoal.train.checkpoint import to_cpu
from shoal.train.checkpointer import Checkpointer
from shoal.train.membership.messages import CheckpointPart, EpochEnd, Final, Progress, Started, Where, encode
from shoal.train.recorder import Recorder
from shoal.train.state import RunState

#: The job's store key the coordinator sets once every live worker can train: the clock.
CLOCK_KEY = "clock/started"
#: The job's store key the coordinator sets when the run collapsed: every worker stops.
COLLAPSED_KEY = "run/collapsed"
#: A worker's steps between two looks at :data:`COLLAPSED_KEY` (a store round trip each).
LOOK_EVERY = 10

if TYPE_CHECKING:
    from shoal.train.trainer import Components, Trainer


class Reporter:
    """Sends a detached worker's reports to the coordinator through ``client`` (its end of
    the parameter servers): each says where the worker is (step, samples, time and byte
    totals, learning rate) besides what it is about."""

    def __init__(self, client: Any, comm: Comm) -> None:
        self.client, self.comm = client, comm

    def __call__(self, kind: type[Where], st: RunState, **fields: Any) -> None:
        """Report ``kind`` (:class:`~shoal.train.membership.messages.Started`, ``EpochEnd``...) with
        ``fields``, and where this worker is."""
        self.client.report(encode(kind(
            worker=self.comm.rank, step=st.step, samples=st.samples,
            times=dict(self.comm.timeline.totals), bytes=self.comm.bytes_sent, lr=st.lr,
            elapsed_s=st.elapsed_s(), **fields)))


class RemoteEvaluator:
    """Leaves testing to the coordinator, which tests the center: no result here (NaN)."""

    eval_s = 0.0

    def test(self, model: nn.Module) -> tuple[float, float]:
        return float("nan"), float("nan")

    def follow(self, loader: ShardLoader) -> None:
        """Nothing to follow: the coordinator reads the test set."""


class RemoteRecorder(Recorder):
    """Keeps this worker's sums and checks its loss as every rank does, writes nothing, and
    reports each epoch's sums (with the model's buffers, which the coordinator's test of the
    center uses) and the run's end."""

    writes = False

    def __init__(self, cfg: TrainConfig, comm: Comm, plan: EpochPlan, report: Reporter,
                 model: nn.Module, classes: int, trained: Callable[[], int]) -> None:
        """``trained()``: the samples this worker has trained on (its strategy's count)."""
        super().__init__(cfg, comm, plan, classes=classes)
        self.report, self.model, self.trained = report, model, trained
        # --eval-every-steps E: this worker says how far it is every E / workers of its own
        # steps, about E global batches' samples of all workers between two tests.
        every = cfg.eval_every_steps
        self.progress_every = max(1, every // plan.world) if every else None
        self.told = False  # the run collapsed: told_to_stop

    def start_clock(self, st: RunState) -> None:
        """Tell the coordinator this worker can train and wait until it says that every
        live worker can (:data:`CLOCK_KEY` in the job's store): no worker trains before the
        run's clock starts, as no rank of a synchronous run does. Then start this worker's."""
        self.report(Started, st)
        store = self.comm.store
        if store is not None:
            try:
                store.wait([CLOCK_KEY], timedelta(seconds=self.cfg.timeout))
            except RuntimeError:  # torch's store timeout
                raise ShoalError(f"the other workers did not all start within --timeout "
                                 f"{self.cfg.timeout:g} s") from None
        st.start()

    def step(self, st: RunState, samples: int) -> None:
        super().step(st, samples)
        if self.progress_every and st.step % self.progress_every == 0:
            self.report(Progress, st, trained=self.trained())

    def told_to_stop(self, st: RunState) -> bool:
        """Whether the run collapsed: this worker's own training sat at chance (its epochs'
        sums, judged as the coordinator judges the run's), or the coordinator said so
        (:data:`COLLAPSED_KEY`, looked up every :data:`LOOK_EVERY` steps). The workers stop,
        as a synchronous run's ranks do, instead of training a collapsed center to the end;
        their own judgement does not wait for the coordinator, which may lag far behind.
        Once told, always told."""
        store = self.comm.store
        self.told = self.told or self.health.stop or (
            store is not None and st.step % LOOK_EVERY == 0 and store.check([COLLAPSED_KEY]))
        return self.told

    def before_update(self, loss_sum: torch.Tensor, st: RunState) -> None:
        """Check this step's loss before its update reaches the servers (or the shared
        parameters): a NaN stops this worker at its own step, the one it computed it in,
        and never reaches the center, where the other workers would pull it and stop at
        their own, unrelated steps (whichever reports first would be named)."""
        if self._check_due(st.step + 1, st.epoch_step + 1):
            self.health.check_loss(float(loss_sum), st.step + 1, st.epoch + 1, st.lr,
                                   self.cfg.checkpoint_path)

    def epoch(self, st: RunState, test: tuple[float, float]) -> None:
        sums = self.epoch_sums()
        self.report(EpochEnd, st, epoch=st.epoch, sums=sums,  # buffers of a model that trained
                    buffers=to_cpu(dict(self.model.named_buffers())) if sums[2] else None)
        if sums[2]:
            super().epoch(st, test)
        else:  # a worker that joined was given nothing of this epoch: no loss to check
            self._epoch_sums.zero_()

    def finish(self, st: RunState, stopped: bool, stop_reason: str | None,
               test: tuple[float, float], parameters: int, extra: dict[str, Any] | None = None,
               lanes: list[Any] | None = None) -> dict[str, Any] | None:
        super().finish(st, stopped, stop_reason, test, parameters)
        self.report(Final, st, stopped=stopped, stopped_by=stop_reason, epoch=st.epoch,
                    train_time_s=st.train_time_s, device=str(self.comm.device),
                    trace=self.tl.chrome_events(self.comm.rank) if self.cfg.trace else None)
        return None


class RemoteCheckpointer(Checkpointer):
    """Sends this worker's part of a checkpoint, with its own position (after SIGTERM each
    worker stops at its own step), to the coordinator, which writes the file once every live
    worker sent its part for the same step."""

    def __init__(self, *parts: Any, report: Reporter) -> None:
        """``parts``: the :class:`Checkpointer`'s."""
        super().__init__(*parts)
        self.report = report

    def position(self, progress: dict[str, Any]) -> dict[str, Any]:
        elastic = {} if self.elastic_part is None else {"elastic": self.elastic_part()}
        return {"progress": progress, "scheduler": self.scheduler.state_dict(), **elastic}

    def resumed(self, payload: dict[str, Any]) -> None:
        if self.cfg.elastic and (payload.get("coordinator") or {}).get("elastic") is not None:
            self.elastic_payload = payload

    def keep(self, own: dict[str, Any], progress: dict[str, Any]) -> None:
        self.report(CheckpointPart, self.state, own=own)


def remote_components(client: Any) -> Callable[[Trainer], Components]:
    """The components of a detached worker whose end of the parameter servers is ``client``
    (for :class:`~shoal.train.trainer.Trainer`'s ``components``)."""
    def make(t: Trainer) -> Components:
        report = Reporter(client, t.comm)
        recorder = RemoteRecorder(t.cfg, t.comm, t.plan, report, t.model, t.data.num_classes,
                                  lambda: detached(t.strategy).samples)
        checkpointer = RemoteCheckpointer(t.cfg, t.comm, t.plan, t.state, recorder, t.amp,
                                          t.scheduler, t.strategy, report=report)
        return RemoteEvaluator(), recorder, checkpointer

    return make
