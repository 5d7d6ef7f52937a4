"""The training loop: one epoch after another, every step through the chosen strategy.

Runs the same in every worker process; ranks appear only through the :class:`Comm` (which
rows of the data this worker reads, and who writes files). Each step is timed into data,
compute, communication, waiting, optimizer and the loop's own bookkeeping. :meth:`Trainer.run`
is the story of a run; its components do the rest: testing is the :class:`Evaluator`'s,
what is recorded and shown the :class:`Recorder`'s, checkpoints the :class:`Checkpointer`'s,
where the run is the :class:`RunState`'s, what of the strategy a checkpoint keeps the
strategy's. A detached worker (of an asynchronous job) gets components that report to its
coordinator instead (:mod:`shoal.train.remote`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.timeline import COMPUTE, DATA, OPTIM, OTHER
from shoal.data import Dataset, EpochPlan, ShardLoader, load_dataset, resolve_workers
from shoal.data.augment import flip_and_crop
from shoal.models import build_model, count_parameters
from shoal.strategies import get_strategy, make_options
from shoal.strategies.base import Strategy
from shoal.strategies.precision import MixedPrecision, clip_gradients, micro_batches
from shoal.train.checkpointer import Checkpointer, read_start
from shoal.train.evaluation import Evaluator
from shoal.train.membership.context import Batches
from shoal.train.membership.tracker.detached import AsyncElastic
from shoal.train.membership.tracker.process_group import Elastic
from shoal.train.optim import build_optimizer, build_schedule, resolve_momentum
from shoal.train.probe import Probe
from shoal.train.recorder import Recorder
from shoal.train.state import RunState
from shoal.train.stopping import COLLAPSED, StopVote
from shoal.train.workload import data_options, preflight

__all__ = ["Components", "Trainer", "data_options", "local_components", "preflight"]


class Tester(Protocol):
    """What the loop asks of its evaluation: a model's test loss and accuracy."""

    eval_s: float

    def test(self, model: nn.Module) -> tuple[float, float]: ...

    def follow(self, loader: ShardLoader) -> None:
        """Read the test set through ``loader`` from now on (a new plan's)."""


#: A trainer's evaluation, records and checkpoints.
Components = tuple[Tester, Recorder, Checkpointer]


def local_components(t: Trainer) -> Components:
    """The components of a worker that tests, records and checkpoints with its peers."""
    evaluator = Evaluator(t.cfg, t.comm, t.loader, t.to_device, t.comm.timeline)
    recorder = Recorder(t.cfg, t.comm, t.plan, evaluator, classes=t.data.num_classes)
    return evaluator, recorder, Checkpointer(t.cfg, t.comm, t.plan, t.state, recorder, t.amp,
                                             t.scheduler, t.strategy)


class Trainer:
    """Trains ``cfg.model`` on ``cfg.dataset`` in this worker; call :meth:`run`.

    ``data`` and ``model`` (at its initial weights): this process's, loaded once
    (:func:`~shoal.train.workload.load_workload`); loaded and built here when not given (a
    fresh trainer on an existing Comm: a planning session's trial). ``components`` makes
    the evaluation, records and checkpoints (:func:`local_components`, or a detached
    worker's :func:`~shoal.train.remote.remote_components`); ``extra``: what the summary
    adds at its end (the launcher's restarts). Its fields are its own: others read them
    through read-only properties (the typed contexts of :mod:`shoal.train.membership.context`)
    and change them through its commands (:meth:`install_plan`, :meth:`join_group`...).
    """

    def __init__(self, cfg: TrainConfig, comm: Comm, data: Dataset | None = None,
                 model: nn.Module | None = None, *,
                 components: Callable[[Trainer], Components] = local_components,
                 extra: dict[str, Any] | None = None) -> None:
        # --momentum auto and the lr it scales, where no launcher resolved them (a Trainer
        # made in Python); resolved settings stay as they are.
        cfg = resolve_momentum(cfg, comm.world_size)
        self._cfg, self._comm, self._extra = cfg, comm, extra
        self._rank, self._world = comm.rank, comm.world_size
        self._device = comm.device
        self._tl = comm.timeline
        if self._device.type == "cuda":
            self._tl.set_synchronize(torch.cuda.synchronize)
        self._data = data if data is not None else load_dataset(cfg.dataset, data_options(cfg))
        self._plan = EpochPlan(len(self._data.train), cfg.global_batch(self._world), self._world,
                               cfg.seed)
        self._loader = self._make_loader(self._plan, self._rank)
        if model is None:
            torch.manual_seed(cfg.seed)  # identical initial weights on every rank
            model = build_model(cfg.model, self._data.input_shape, self._data.num_classes)
        self._model = model.to(self._device)
        start = read_start(cfg, comm, self._model) \
            if cfg.init_from and cfg.resume_path is None else None
        if cfg.channels_last:
            self._model.to(memory_format=torch.channels_last)
        self._amp = MixedPrecision(cfg.precision, self._device)
        self._optimizer = build_optimizer(cfg, self._model.parameters(), cfg.base_lr(self._world))
        self._scheduler = build_schedule(cfg, self._optimizer, self._plan.steps_per_epoch)
        torch.manual_seed(cfg.seed + 1 + self._rank)  # dropout differs between ranks
        augment = torch.Generator().manual_seed(cfg.seed + 10_007 * (self._rank + 1))
        self._state = RunState(comm, augment, lr=self._optimizer.param_groups[0]["lr"])
        # Every strategy starts all workers from rank 0's model (--init-from: the checkpoint's
        # evaluation model); a resumed run then puts back what each worker had.
        strategy_cls = get_strategy(cfg.strategy)
        self._strategy = strategy_cls(self._model, self._optimizer, comm,
                                      make_options(strategy_cls, cfg.strategy_options))
        self._strategy.scaler = self._amp.scaler
        if cfg.compile:  # after the strategy copied the model (EASGD's center: uncompiled)
            self._model.compile()
        self._evaluator, self._recorder, self._checkpointer = components(self)
        if cfg.resume_path is not None:
            self._checkpointer.resume()
        elif start is not None and cfg.init_progress:
            self._checkpointer.go_on_from(start)
        # SIGTERM stops every rank after the same step, voted at the strategy's meeting points.
        self._stop_vote = StopVote(self._strategy.stop_peers, self._strategy.meets_after)
        self._probe = Probe.of(cfg, self._plan.steps_per_epoch, comm)  # --plan-probe's
        self._stop_reason: str | None = None  # "SIGTERM" or COLLAPSED (the ranks agreed), "probe"
        # --elastic: who trains what after a worker is lost (a detached worker: its schedule)
        self._elastic: Elastic | AsyncElastic = AsyncElastic(self) \
            if cfg.elastic and comm.ps is not None else Elastic(self)
        self._joined = False  # a worker that joined a running job (shoal join)

    def _make_loader(self, plan: EpochPlan, shard: int) -> ShardLoader:
        """The loader of shard ``shard`` of ``plan`` (the one place a trainer makes one)."""
        return ShardLoader(self._data, plan, shard,
                           resolve_workers(self._cfg.loader_workers, self._data.train),
                           pin_memory=self._device.type == "cuda", seed=self._cfg.seed)

    # -- what its components read: read-only (a new plan is installed, never set) -----------
    @property
    def cfg(self) -> TrainConfig:
        """The run's settings (``--momentum auto`` resolved)."""
        return self._cfg

    @property
    def comm(self) -> Comm:
        return self._comm

    @property
    def rank(self) -> int:
        """This worker's place in the group (as of the last :meth:`regroup`)."""
        return self._rank

    @property
    def data(self) -> Dataset:
        return self._data

    @property
    def plan(self) -> EpochPlan:
        """The plan being trained (:meth:`install_plan` installs a new one)."""
        return self._plan

    @property
    def loader(self) -> ShardLoader:
        """The loader of this worker's shard of :attr:`plan`."""
        return self._loader

    @property
    def batches(self) -> Batches:
        """The current epoch's batches, as the loop takes them."""
        return self._batches

    @property
    def model(self) -> nn.Module:
        """This worker's model (the strategy's evaluation model may be another)."""
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def scheduler(self) -> LRScheduler:
        return self._scheduler

    @property
    def amp(self) -> MixedPrecision:
        return self._amp

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def state(self) -> RunState:
        """Where the run is."""
        return self._state

    @property
    def recorder(self) -> Recorder:
        return self._recorder

    @property
    def checkpointer(self) -> Checkpointer:
        return self._checkpointer

    @property
    def elastic(self) -> Elastic | AsyncElastic:
        """Its side of the job's membership (``--elastic``; a no-op without)."""
        return self._elastic

    # -- commands ------------------------------------------------------------------------------
    def install_plan(self, plan: EpochPlan, shard: int) -> None:
        """Train from ``plan`` from now on, as its shard ``shard``, from the current epoch's
        first step of it. The one way a new plan is installed: the loader is made anew, and
        the evaluation, records and checkpoints follow it.

        Args:
            plan: the plan (of an epoch, or of its rest) over the workers there are now.
            shard: which of its shards this worker reads: its place among those workers.
        """
        self._loader.close()
        self._plan = plan
        self._loader = self._make_loader(plan, shard)
        self._evaluator.follow(self._loader)
        self._recorder.plan = plan
        self._checkpointer.follow(plan, self._state.epoch)
        self._batches = self._loader.epoch(self._state.epoch, 0)

    def regroup(self) -> None:
        """The group was re-formed (a worker lost or joined): this rank's place in it, and
        the strategy's state that depends on it."""
        self._rank, self._world = self._comm.rank, self._comm.world_size
        self._strategy.regroup()

    def join_group(self, side: Elastic) -> None:
        """A worker that joined a running job (``shoal join``), in the group re-formed with
        it: ``side`` is its side of the membership (which the hand-over fills); the stop vote
        is among the grown group's peers, and this rank's place is taken (:meth:`regroup`)."""
        self._elastic, self._joined = side, True
        self._stop_vote = StopVote(self._strategy.stop_peers, self._strategy.meets_after)
        self.regroup()

    def join_detached(self, epoch: int) -> None:
        """A detached worker that joined a running asynchronous job at ``epoch`` (the
        records'): its membership side says what it took and waits for what it is given."""
        if not isinstance(self._elastic, AsyncElastic):
            raise TypeError("only a detached worker of an --elastic job joins one")
        self._joined = True
        self._elastic.join(epoch)

    def close_loader(self) -> None:
        """Stop the loader (its worker processes): :meth:`run` does at its end, a worker
        that leaves the job mid-run (``Leaving``) here."""
        self._loader.close()

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        """Train to ``cfg.epochs`` (or ``cfg.stop_at_step``); rank 0 returns the summary."""
        cfg, st, rec = self._cfg, self._state, self._recorder
        rec.begin(st, self._data.describe())  # output directory, metrics.jsonl, first line
        if self._joined:  # the others' clock runs already: no barrier they would not come to
            st.start()
        else:
            rec.start_clock(st)  # from when every worker can train, whatever its start-up took
        stopped = False
        test = (float("nan"), float("nan"))  # the last evaluation's loss and accuracy
        while st.epoch < cfg.epochs:
            stopped = self._epoch()
            if stopped:
                break
            st.epoch_done()
            if st.epoch % cfg.eval_every == 0 or st.epoch == cfg.epochs:
                test = self.test()
            rec.epoch(st, test)
            if not cfg.checkpoint_every:
                self._checkpointer.save()
            # Collapsed: every rank saw the same reduced numbers. (An asynchronous run's
            # coordinator judges its records; its workers train on.)
            if rec.health.stop and rec.writes:
                stopped = True
                break
        rec.stop_profiler(st)  # a --profile window past the last step
        self._stop_vote.settle()
        if self._checkpointer.saved_at != st.step:  # stopped, or the last one was before the end
            self._checkpointer.save()
        if not stopped and math.isnan(test[1]):
            test = self.test()
        self._loader.close()
        return rec.finish(st, stopped, self._stop_reason, test, count_parameters(self._model),
                          self._extra)

    def _epoch(self) -> bool:
        """The steps of the current epoch (resumed: from its step); whether to stop."""
        cfg, st, rec = self._cfg, self._state, self._recorder
        self._elastic.start_epoch()
        self._batches = self._loader.epoch(st.epoch, st.epoch_step)
        # the model itself: DDP's wrapper (elastic: wrapped at the first step, a meeting that
        # may see a worker lost) is made inside the step, where a change is settled
        self._strategy.model.train()
        rec.start_epoch(st)
        stopped = False
        while not stopped and self._elastic.steps_left():  # the last closes the epoch
            rec.before_step(st)  # --profile's window may open here
            started = time.perf_counter()
            with self._tl.span(OTHER, "step"):
                loss_sum, correct, n, n_global = self._elastic.step(self.train_step)
                rec.add(loss_sum, correct, n)
            st.step_done(n_global, time.perf_counter() - started)
            self._elastic.step_done()
            rec.step(st, n_global)  # step record, progress
            stopped = self._stop_now()
            if cfg.eval_every_steps and st.epoch_step < self._plan.steps_per_epoch and (
                    st.epoch_step % cfg.eval_every_steps == 0
                    or (stopped and self._stop_reason is None)):
                rec.evaluation(st, self.test())
            if not stopped and cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0:
                self._checkpointer.save()
        rec.end_steps()
        return stopped

    def _stop_now(self) -> bool:
        """Whether to stop after this step: ``--stop-at-step``, SIGTERM on some rank,
        ``--plan-probe``'s decision, or an asynchronous run's collapse."""
        if self._cfg.stop_at_step is not None and self._state.step >= self._cfg.stop_at_step:
            return True
        told = self._recorder.told_to_stop(self._state)
        agreed = self._stop_vote.agreed(self._state.step, COLLAPSED if told else None)
        if agreed is not None:
            self._stop_reason = agreed
        elif self._probe is not None and self._probe.stops(self._state.step):
            self._stop_reason = "probe"
        return self._stop_reason is not None

    # -- one step -----------------------------------------------------------------------------
    def to_device(self, x: torch.Tensor, y: torch.Tensor,
                  train: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch where the model runs (a training batch augmented first, ``--augment``)."""
        if train and self._cfg.augment:
            x = flip_and_crop(x, self._state.aug_gen)
        # Copied as read (from pinned memory with loader workers), then made channels-last
        # where the model runs: a copy on the CPU first would be unpinned and CPU time.
        x = x.to(self._device, non_blocking=True)
        if self._cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self._device, non_blocking=True)

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor, int]]
                   ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """One step on the next of this rank's ``batches`` (:meth:`ShardLoader.epoch`):
        returns (loss sum, correct, local samples, global samples) of the batch.

        With ``--accumulate K`` this worker's share is K micro-batches, each one's mean loss
        weighted by its rows, whose gradients add up before one update; only the last
        backward communicates (:meth:`Strategy.no_sync`). The loop looks it up on the
        trainer at each step: a wrapper set on the instance (a test's, to signal itself
        during a given step) takes its place."""
        tl, strategy, cfg = self._tl, self._strategy, self._cfg
        with tl.span(DATA):
            x, y, n_global = next(batches)
            x, y = self.to_device(x, y, train=True)
            n = len(y)
        loss_sum = correct = torch.zeros((), device=self._device)
        with tl.span(COMPUTE):
            strategy.batch_share = (n, n_global)
            pieces = list(micro_batches(n, cfg.accumulate))
            for i, (lo, hi) in enumerate(pieces):
                with strategy.no_sync(i < len(pieces) - 1):
                    with self._amp.autocast():
                        out = strategy.module(x[lo:hi])
                        loss = F.cross_entropy(out, y[lo:hi]).float()
                    strategy.backward(loss if len(pieces) == 1 else loss * ((hi - lo) / n))
                with torch.no_grad():
                    loss_sum = loss_sum + loss.detach() * (hi - lo)
                    correct = correct + (out.argmax(1) == y[lo:hi]).sum()
        with tl.span(OPTIM):
            if self._amp.unscale(self._optimizer) and cfg.clip_grad_norm is not None:
                clip_gradients(self._model, cfg.clip_grad_norm)  # after sync's all-reduce
            self._state.lr = self._optimizer.param_groups[0]["lr"]  # the rate this step used
            self._recorder.before_update(loss_sum, self._state)
            with self._elastic.updating():
                strategy.step()
            self._amp.update()
            self._scheduler.step()
            strategy.zero_grad()
        return loss_sum, correct, n, n_global

    def test(self) -> tuple[float, float]:
        """The strategy's evaluation model tested (by the evaluator: time booked)."""
        return self._evaluator.test(self._strategy.eval_module)
