"""A run's checkpoints as the trainer keeps them: :class:`Checkpointer`.

What goes into ``checkpoint.pt`` is each part's own to say: the run state's position and
this rank's RNGs and totals (:class:`~shoal.train.state.RunState`), the records' epoch sums
(:class:`~shoal.train.recorder.Recorder`), the gradient scaler, the schedule, and what the
strategy keeps once and per rank. The Checkpointer gathers them (rank 0 writes, atomically:
:func:`write_checkpoint`) and hands each its part back on ``--resume``. An asynchronous
job's coordinator writes its file with :func:`write_checkpoint` too, from its workers'
reports; a detached worker's parts go to it (:class:`~shoal.train.remote.RemoteCheckpointer`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.ops import all_finite
from shoal.core.timeline import CHECKPOINT
from shoal.data import EpochPlan
from shoal.errors import ShoalError
from shoal.strategies import Strategy, get_strategy
from shoal.strategies.precision import MixedPrecision
from shoal.train.checkpoint import (
    CHECKPOINT_HEADER,
    EVAL_MODEL,
    check_init,
    check_resume,
    eval_model,
    load_checkpoint,
    load_eval_model,
    save_checkpoint,
    to_cpu,
)
from shoal.train.membership.changes import MembershipChange, records
from shoal.train.membership.resume import SavedPlan
from shoal.train.optim import schedule_at
from shoal.train.recorder import Recorder
from shoal.train.state import RunState


def with_strategy(cfg: TrainConfig, ours: dict[str, Any], theirs: dict[str, Any], hook: str,
                  reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """The trainer's part of a checkpoint and the strategy's, which must not overwrite it
    (nor the ``reserved`` keys)."""
    if clash := sorted((ours.keys() | set(reserved)) & theirs.keys()):
        raise ShoalError(f"strategy {cfg.strategy}: {hook}() returns {clash[0]!r}, "
                         "a checkpoint key of the trainer's; rename it")
    return {**ours, **theirs}


def write_checkpoint(cfg: TrainConfig, plan: EpochPlan, *, progress: dict[str, Any],
                     scheduler: dict[str, Any], ranks: list[Any], evaluated: dict[str, Any],
                     shared: dict[str, Any], order: Any = None,
                     changes: list[MembershipChange] | None = None) -> None:
    """Write ``checkpoint.pt``: the run's settings and position (the epoch's plan, and its
    ``order`` where the epoch's rest was dealt anew), each rank's part (``ranks``), the
    model it evaluates, what the strategy keeps once (``shared``) and the membership
    ``changes`` so far."""
    payload = {"config": cfg.to_dict(), "global_batch": plan.global_batch,
               "world_size": plan.world, "plan_order": order, "progress": progress,
               "scheduler": scheduler, "ranks": ranks, EVAL_MODEL: evaluated,
               "membership_changes": records(changes)}
    save_checkpoint(cfg.checkpoint_path, with_strategy(cfg, payload, shared, "checkpoint_shared",
                                                       reserved=CHECKPOINT_HEADER))


def read_on_main(comm: Comm, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``read()`` on rank 0, its result (or its one-line error) sent to every rank; a rank
    with no peers (an asynchronous job's worker) reads for itself."""
    result, error = None, None
    if comm.rank == 0 or not comm.active:
        try:
            result = read()
        except ShoalError as exc:
            result, error = None, str(exc)
    if comm.active:
        result, error = comm.broadcast_object((result, error))
    if error:
        raise ShoalError(error)
    return result


def summed_sums(parts: list[dict[str, Any] | None]) -> list[float] | None:
    """The epoch sums (loss, accuracy, samples so far) of the ranks' ``parts`` of a
    checkpoint, added up elementwise; ``None`` when no part holds any."""
    sums = [part["epoch_sums"] for part in parts if part is not None]
    return [float(sum(v)) for v in zip(*sums, strict=True)] or None


def read_start(cfg: TrainConfig, comm: Comm, model: nn.Module) -> dict[str, Any]:
    """``--init-from``: rank 0 reads the checkpoint and sends all ranks its evaluation model
    (loaded into ``model`` here, before a strategy copies it), position and epoch sums."""
    def read() -> dict[str, Any]:
        payload = load_checkpoint(Path(cfg.init_from))
        check_init(payload, cfg, comm.world_size)
        return {"model": eval_model(payload), "progress": payload["progress"],
                "epoch_sums": summed_sums(payload["ranks"])}

    start = read_on_main(comm, read)
    load_eval_model(model, {EVAL_MODEL: start["model"]}, cfg.init_from)
    return start


class Checkpointer:
    """The trainer's checkpoints: :meth:`save` gathers every rank's part to rank 0, which
    writes the file; :meth:`resume` and :meth:`go_on_from` give each part its state back.
    :attr:`saved_at`: the step of the last checkpoint this invocation wrote."""

    def __init__(self, cfg: TrainConfig, comm: Comm, plan: EpochPlan, state: RunState,
                 recorder: Recorder, amp: MixedPrecision, scheduler: Any,
                 strategy: Strategy) -> None:
        self.cfg, self.comm, self.plan = cfg, comm, plan
        self.state, self.recorder, self.amp = state, recorder, amp
        self.scheduler, self.strategy = scheduler, strategy
        self.saved_at = -1
        self.saved_plan: SavedPlan | None = None  # --resume: the checkpoint's epoch plan
        self.plan_epoch: int | None = None  # the epoch a plan of an epoch's rest is of
        #: ``--elastic``: this rank's part of its side (:meth:`position`), and at
        #: ``--resume`` the part the checkpoint holds of this rank
        self.elastic_part: Callable[[], dict[str, Any]] | None = None
        self.own_part: dict[str, Any] | None = None
        #: a detached worker's ``--resume``: where it goes on from (its coordinator's part)
        self.elastic_payload: dict[str, Any] | None = None

    def follow(self, plan: EpochPlan, epoch: int) -> None:
        """Checkpoint ``plan`` from now on: a plan of the rest of ``epoch`` (its order goes
        into a checkpoint of that epoch)."""
        self.plan, self.plan_epoch = plan, epoch

    def save(self) -> None:
        """Write ``checkpoint.pt`` atomically (rank 0): the progress, what the strategy shares
        once, the schedule, and every rank's own state (run state, epoch sums, strategy's)."""
        self._check_finite("checkpoint not written, the last good one is kept")
        with self.comm.timeline.span(CHECKPOINT):
            run = self.state.state_dict()
            own = with_strategy(self.cfg, {**run["rank"], **self.recorder.state_dict(),
                                           "precision": self.amp.state_dict(),
                                           **self.position(run["progress"])},
                                self.strategy.checkpoint_own(), "checkpoint_own")
            self.keep(to_cpu(own), run["progress"])
        self.saved_at = self.state.step

    def position(self, progress: dict[str, Any]) -> dict[str, Any]:
        """What this rank's part says of its position (the run's is the file's; under
        ``--elastic`` the samples it trained that have not counted yet)."""
        return {} if self.elastic_part is None else {"elastic": self.elastic_part()}

    def keep(self, own: dict[str, Any], progress: dict[str, Any]) -> None:
        """Gather every rank's part ``own``; rank 0 writes the file."""
        ranks = self.comm.gather_objects(own)
        if self.comm.rank == 0:
            write_checkpoint(self.cfg, self.plan, progress=progress,
                             scheduler=self.scheduler.state_dict(), ranks=ranks,
                             evaluated=to_cpu(self.strategy.eval_module.state_dict()),
                             shared=to_cpu(self.strategy.checkpoint_shared()),
                             order=self.plan.order if self.plan_epoch == progress["epoch"]
                             else None,  # at an epoch's end, the last one's rest is done
                             changes=self.recorder.changes)

    def resume(self) -> None:
        """Rank 0 reads the checkpoint and sends it to all (errors reach every rank); each
        part puts back its own."""
        def read() -> dict[str, Any]:
            payload = load_checkpoint(self.cfg.resume_path)
            check_resume(payload, self.cfg, self.comm.world_size, get_strategy(self.cfg.strategy))
            return payload

        payload = read_on_main(self.comm, read)
        ranks = payload["ranks"]
        own = ranks[self.comm.rank] if self.comm.rank < len(ranks) else None
        # A worker the checkpoint has no state of: in-sync replicas start from the shared
        # model; drifting ones (resumed at an epoch's end) take worker 0's, as a joiner does.
        drifts = own is None and not self.strategy.replicas_in_sync
        self.strategy.restore_checkpoint(payload, ranks[0] if drifts else own)
        # Replicas in sync scale their losses alike: a rank the checkpoint has no state of
        # takes the first rank's scaler.
        mine = own if own is not None else next((r for r in ranks if r), None)
        self.amp.load_state_dict(mine.get("precision") if mine else None)
        # A part that holds its rank's own position (an asynchronous worker's, which stops
        # at its own step) goes on from there; otherwise from the run's.
        position = own if own is not None and "progress" in own else payload
        self.scheduler.load_state_dict(position["scheduler"])
        self.state.load_state_dict({"progress": position["progress"], "rank": own})
        self.recorder.load_state_dict(self._with_dropped(own, ranks))
        self.saved_plan, self.own_part = SavedPlan.of(payload), own
        self.resumed(payload)

    def _with_dropped(self, own: dict[str, Any] | None, ranks: list[Any]
                      ) -> dict[str, Any] | None:
        """``own``; on rank 0 of a run resumed on fewer workers than wrote the checkpoint,
        with their epoch sums added to its own (the epoch's records count their steps)."""
        dropped = [r for r in ranks[self.comm.world_size:] if r]
        if self.comm.rank != 0 or own is None or not dropped:
            return own
        return {**own, "epoch_sums": summed_sums([own, *dropped])}

    def resumed(self, payload: dict[str, Any]) -> None:
        """After :meth:`resume` put back every part: what else this rank takes from the file."""

    def go_on_from(self, start: dict[str, Any]) -> None:
        """``--init-progress``: the position (step, epoch: the data order), the schedule at
        that step (with this run's rate) and the epoch's sums so far (all ranks', counted
        once, on rank 0); the optimizer and strategy start fresh."""
        progress = start["progress"]
        self.state.load_state_dict({"progress": progress, "rank": None})
        schedule_at(self.scheduler, progress["step"])
        if self.comm.rank == 0 and start["epoch_sums"] is not None:
            self.recorder.load_state_dict({"epoch_sums": start["epoch_sums"]})

    def _check_finite(self, what: str) -> None:
        bad = not all_finite(self.strategy.eval_module.parameters())  # hogwild: shared
        if self.comm.reduce_values([float(bad)], "max")[0]:
            raise ShoalError(f"parameters became non-finite by step {self.state.step}; "
                             f"{what} (lower --lr?)")
