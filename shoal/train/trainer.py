"""The training loop: one epoch after another, every step through the chosen strategy.

Runs the same in every worker process; ranks appear only through the :class:`Comm` (which
rows of the data this worker reads, and who writes files). Each step is timed into data,
compute, communication, waiting, optimizer and the loop's own bookkeeping. :meth:`Trainer.run`
is the story of a run: what is recorded and shown is the :class:`Recorder`'s business, where
the run is the :class:`RunState`'s, what of the strategy a checkpoint keeps the strategy's.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.files import check_output_dir
from shoal.core.timeline import CHECKPOINT, COMPUTE, DATA, EVAL, OPTIM, OTHER
from shoal.data import DataOptions, Dataset, EpochPlan, ShardLoader, load_dataset, resolve_workers
from shoal.data.augment import flip_and_crop
from shoal.errors import ShoalError
from shoal.models import build_model, count_parameters
from shoal.strategies import Strategy, get_strategy, make_options
from shoal.strategies.precision import MixedPrecision, clip_gradients, micro_batches
from shoal.train.checkpoint import (
    CHECKPOINT_HEADER,
    EVAL_MODEL,
    check_init,
    check_resume,
    eval_model,
    load_checkpoint,
    resumes_in_place,
    save_checkpoint,
    to_cpu,
)
from shoal.train.elastic import Elastic
from shoal.train.optim import build_optimizer, build_schedule, schedule_at
from shoal.train.recorder import Recorder
from shoal.train.records import require_tensorboard
from shoal.train.state import RunState
from shoal.train.stopping import StopVote


def data_options(cfg: TrainConfig) -> DataOptions:
    return DataOptions(cfg.data_dir, cfg.seed, tuple(cfg.synthetic_shape), cfg.synthetic_classes,
                       cfg.synthetic_samples, cfg.image_size, cfg.synthetic_noise)


def preflight(cfg: TrainConfig, world: int, data: Dataset | None = None) -> Dataset:
    """Everything that can be checked before workers start: data, model fit, strategy
    options, output directory and resume file. Returns the loaded dataset (``data`` when
    given: a dataset handed over in Python)."""
    strategy_cls = get_strategy(cfg.strategy)
    options = make_options(strategy_cls, cfg.strategy_options, world)
    if cfg.eval_every_steps and getattr(strategy_cls, "asynchronous", False):
        raise ShoalError(f"--eval-every-steps: {cfg.strategy}'s center is tested by its server "
                         "at epoch ends only; leave it out")
    if cfg.tensorboard:
        require_tensorboard()
    data = data if data is not None else load_dataset(cfg.dataset, data_options(cfg))
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    if cfg.init_from is not None and cfg.resume_path is None:
        start = load_checkpoint(Path(cfg.init_from))
        check_init(start, cfg, world)
        load_eval_model(model, start, cfg.init_from)
    # A strategy alone (rank 0 of the job's size, no other rank to talk to) checks how it
    # fits the model and optimizer.
    strategy_cls(model, build_optimizer(cfg, model.parameters(), cfg.base_lr(world)),
                 Comm(Environment(world_size=world, local_world_size=world), torch.device("cpu"),
                      peers=False), options)
    EpochPlan(len(data.train), cfg.global_batch(world), world, cfg.seed)
    check_features(cfg, data)
    out = Path(cfg.out)
    check_output_dir(out)
    holds_run = any((out / f).exists() for f in ("checkpoint.pt", "metrics.jsonl"))
    if cfg.resume_path is not None:
        check_resume(load_checkpoint(cfg.resume_path), cfg, world, strategy_cls)
    if cfg.continues_from is not None:
        if holds_run and not resumes_in_place(cfg) and not (cfg.init_from and cfg.overwrite):
            raise ShoalError(f"--out {out} already holds another run; going on from "
                             f"{cfg.continues_from} there would replace it: choose a new --out")
    elif not cfg.overwrite and holds_run:
        raise ShoalError(f"{out} already holds a run; pass --resume to continue it or "
                         "--overwrite to start over")
    return data


def check_features(cfg: TrainConfig, data: Dataset) -> None:
    """``--channels-last`` and ``--compile`` where they can work, in one line each."""
    if cfg.channels_last and len(data.input_shape) != 3:
        raise ShoalError(f"--channels-last needs image inputs (channels x height x width); "
                         f"{cfg.dataset}'s are {'x'.join(map(str, data.input_shape))}")
    if cfg.compile:
        # torch.compile's backend generates C++ on the CPU and Triton kernels on a GPU.
        gpu = cfg.device != "cpu" and torch.cuda.is_available()
        if gpu and importlib.util.find_spec("triton") is None:
            raise ShoalError("--compile on a GPU needs Triton (pip install triton)")
        compiler = os.environ.get("CXX", "g++")  # the one torch's inductor runs
        if not gpu and shutil.which(compiler) is None:
            raise ShoalError(f"--compile on the CPU needs a C++ compiler, and {compiler} is not "
                             "found (install g++ or set CXX), or leave out --compile")


def load_eval_model(model: nn.Module, payload: dict[str, Any], source: str | Path) -> None:
    """Put ``payload``'s evaluation model into ``model``, or a one-line error."""
    try:
        model.load_state_dict(eval_model(payload))
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[-1].strip()
        raise ShoalError(f"the evaluation model of {source} does not fit this run's model "
                         f"({first})") from None


class Trainer:
    """Trains ``cfg.model`` on ``cfg.dataset`` in this worker; call :meth:`run`."""

    def __init__(self, cfg: TrainConfig, comm: Comm, data: Dataset | None = None) -> None:
        self.cfg, self.comm = cfg, comm
        self.rank, self.world = comm.rank, comm.world_size
        self.device = comm.device
        self.is_main = self.rank == 0
        self.tl = comm.timeline
        if self.device.type == "cuda":
            self.tl.set_synchronize(torch.cuda.synchronize)
        self.data = data if data is not None else load_dataset(cfg.dataset, data_options(cfg))
        self.plan = EpochPlan(len(self.data.train), cfg.global_batch(self.world), self.world,
                              cfg.seed)
        self.loader = ShardLoader(self.data, self.plan, self.rank,
                                  resolve_workers(cfg.loader_workers, self.data.train),
                                  pin_memory=self.device.type == "cuda", seed=cfg.seed)
        strategy_cls = get_strategy(cfg.strategy)
        #: An asynchronous strategy's workers never wait for each other: this worker writes
        #: nothing into --out and evaluates nothing; it reports its sums, checkpoint state and
        #: totals to the parameter server's coordinator (server 0), which keeps the records.
        self.detached = bool(getattr(strategy_cls, "asynchronous", False))
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.model = build_model(cfg.model, self.data.input_shape,
                                 self.data.num_classes).to(self.device)
        start = self._init_from() if cfg.init_from and cfg.resume_path is None else None
        if cfg.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.amp = MixedPrecision(cfg.precision, self.device)
        self.optimizer = build_optimizer(cfg, self.model.parameters(), cfg.base_lr(self.world))
        self.scheduler = build_schedule(cfg, self.optimizer, self.plan.steps_per_epoch)
        torch.manual_seed(cfg.seed + 1 + self.rank)  # dropout differs between ranks
        augment = torch.Generator().manual_seed(cfg.seed + 10_007 * (self.rank + 1))
        self.state = RunState(comm, augment, lr=self.optimizer.param_groups[0]["lr"])
        self.recorder = Recorder(cfg, comm, self.plan, writes=not self.detached)
        # Every strategy starts all workers from rank 0's model (--init-from: the checkpoint's
        # evaluation model); a resumed run then puts back what each worker had.
        self.strategy = strategy_cls(self.model, self.optimizer, comm,
                                     make_options(strategy_cls, cfg.strategy_options))
        self.strategy.scaler = self.amp.scaler
        if cfg.compile:  # after the strategy copied the model (EASGD's center: uncompiled)
            self.model.compile()
        if cfg.resume_path is not None:
            self._resume(strategy_cls)
        elif start is not None and cfg.init_progress:
            self._go_on_from(start)
        # SIGTERM stops every rank after the same step, voted at the strategy's meeting points.
        self.stop_vote = StopVote(self.strategy.stop_peers, self.strategy.meets_after)
        self.stop_reason: str | None = None  # "SIGTERM" once the ranks agreed to stop
        self.saved_at = -1  # the step of the last checkpoint this invocation wrote
        self.elastic = Elastic(self)  # --elastic: who trains what after a worker is lost

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        """Train to ``cfg.epochs`` (or ``cfg.stop_at_step``); rank 0 returns the summary."""
        cfg, st, rec = self.cfg, self.state, self.recorder
        st.start()
        rec.begin(st, self.data.describe())  # output directory, metrics.jsonl, first line
        stopped = False
        test = (float("nan"), float("nan"))  # the last evaluation's loss and accuracy
        while st.epoch < cfg.epochs:
            self.elastic.start_epoch()
            self.batches = self.loader.epoch(st.epoch, st.epoch_step)  # resumed: from its step
            self.strategy.module.train()
            rec.start_epoch(st)
            while not stopped and self.elastic.steps_left():  # the last closes the epoch
                rec.before_step(st)  # --profile's window may open here
                started = time.perf_counter()
                with self.tl.span(OTHER, "step"):
                    loss_sum, correct, n, n_global = self.elastic.step(self.train_step)
                    rec.add(loss_sum, correct, n)
                st.step_done(n_global, time.perf_counter() - started)
                self.elastic.step_done()
                rec.step(st, n_global)  # step record, progress
                stopped = self._stop_now()
                if cfg.eval_every_steps and st.epoch_step < self.plan.steps_per_epoch and (
                        st.epoch_step % cfg.eval_every_steps == 0
                        or (stopped and self.stop_reason is None)):
                    rec.evaluation(st, self.test())
                if not stopped and cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0:
                    self.save()
            rec.end_steps()
            if stopped:
                break
            st.epoch_done()
            if self.detached:
                self._report("epoch", epoch=st.epoch, sums=rec.epoch_sums(),
                             buffers=to_cpu(dict(self.model.named_buffers())))
            if st.epoch % cfg.eval_every == 0 or st.epoch == cfg.epochs:
                test = self.test()
            rec.epoch(st, test)
            if not cfg.checkpoint_every:
                self.save()
        rec.stop_profiler(st)  # a --profile window past the last step
        self.stop_vote.settle()
        if self.saved_at != st.step:  # stopped, or the last checkpoint was before the end
            self.save()
        if not stopped and math.isnan(test[1]):
            test = self.test()
        self.loader.close()
        summary = rec.finish(st, stopped, self.stop_reason, test, count_parameters(self.model))
        if self.detached:
            self._report("final", stopped=stopped, stopped_by=self.stop_reason,
                         epoch=st.epoch, train_time_s=st.train_time_s, device=str(self.device),
                         trace=self.tl.chrome_events(self.rank) if self.cfg.trace else None)
        return summary

    def _report(self, kind: str, **fields: Any) -> None:
        """Detached: tell the coordinator where this worker is (``kind``: epoch, checkpoint,
        final), with what every report carries: step, samples, time totals, bytes, lr."""
        st = self.state
        self.strategy.report({"kind": kind, "worker": self.rank, "step": st.step,
                              "samples": st.samples, "times": dict(self.tl.totals),
                              "bytes": self.comm.bytes_sent, "lr": st.lr,
                              "elapsed_s": st.elapsed_s(), **fields})

    def _stop_now(self) -> bool:
        """Whether to stop after this step: ``--stop-at-step``, or SIGTERM on some rank."""
        if self.cfg.stop_at_step is not None and self.state.step >= self.cfg.stop_at_step:
            return True
        if self.stop_vote.agreed(self.state.step):
            self.stop_reason = "SIGTERM"
            return True
        return False

    # -- one step -----------------------------------------------------------------------------
    def _batch(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> tuple[torch.Tensor, ...]:
        if train and self.cfg.augment:
            x = flip_and_crop(x, self.state.aug_gen)
        # Copied as read (from pinned memory with loader workers), then made channels-last
        # where the model runs: a copy on the CPU first would be unpinned and CPU time.
        x = x.to(self.device, non_blocking=True)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor, int]]
                   ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """One step on the next of this rank's ``batches`` (:meth:`ShardLoader.epoch`):
        returns (loss sum, correct, local samples, global samples) of the batch.

        With ``--accumulate K`` this worker's share is K micro-batches, each one's mean loss
        weighted by its rows, whose gradients add up before one update; only the last
        backward communicates (:meth:`Strategy.no_sync`)."""
        tl, strategy, cfg = self.tl, self.strategy, self.cfg
        with tl.span(DATA):
            x, y, n_global = next(batches)
            x, y = self._batch(x, y, train=True)
            n = len(y)
        loss_sum = correct = torch.zeros((), device=self.device)
        with tl.span(COMPUTE):
            strategy.batch_share = (n, n_global)
            pieces = list(micro_batches(n, cfg.accumulate))
            for i, (lo, hi) in enumerate(pieces):
                with strategy.no_sync(i < len(pieces) - 1):
                    with self.amp.autocast():
                        out = strategy.module(x[lo:hi])
                        loss = F.cross_entropy(out, y[lo:hi]).float()
                    strategy.backward(loss if len(pieces) == 1 else loss * ((hi - lo) / n))
                with torch.no_grad():
                    loss_sum = loss_sum + loss.detach() * (hi - lo)
                    correct = correct + (out.argmax(1) == y[lo:hi]).sum()
        with tl.span(OPTIM):
            if self.amp.unscale(self.optimizer) and cfg.clip_grad_norm is not None:
                clip_gradients(self.model, cfg.clip_grad_norm)  # after sync's all-reduce
            self.state.lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
            with self.elastic.updating():
                strategy.step()
            self.amp.update()
            self.scheduler.step()
            strategy.zero_grad()
        return loss_sum, correct, n, n_global

    # -- evaluation ---------------------------------------------------------------------------
    def test(self) -> tuple[float, float]:
        """:meth:`evaluate`, its time booked (timeline and the records' ``eval_s``)."""
        started = time.perf_counter()
        with self.tl.span(EVAL):
            result = self.evaluate()
        self.recorder.eval_s += time.perf_counter() - started
        return result

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Test loss and accuracy of the strategy's evaluation model; each rank a shard.
        (Detached workers leave it to the coordinator: NaN.)"""
        if self.detached:
            return float("nan"), float("nan")
        model: nn.Module = self.strategy.eval_module
        was_training = model.training
        model.eval()
        test = self.data.test
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        batch = max(256, 2 * self.cfg.batch_size)
        for x, y in self.loader.test_batches(batch, self.world):
            x, y = self._batch(x, y, train=False)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").double()
            correct += (out.argmax(1) == y).sum()
        model.train(was_training)
        total_loss, total_correct = self.comm.reduce_values([loss_sum.item(), correct.item()])
        return total_loss / len(test), total_correct / len(test)

    # -- checkpoints --------------------------------------------------------------------------
    def save(self) -> None:
        """Write ``checkpoint.pt`` atomically (rank 0): the progress, what the strategy shares
        once, the schedule, and every rank's own state (run state, epoch sums, strategy's)."""
        self._check_finite("checkpoint not written, the last good one is kept")
        with self.tl.span(CHECKPOINT):
            run = self.state.state_dict()
            # A detached worker's position is its own (after SIGTERM each stops at its step).
            position = {"progress": run["progress"], "scheduler": self.scheduler.state_dict()} \
                if self.detached else {}
            own = self._with_strategy({**run["rank"], **self.recorder.state_dict(),
                                       "precision": self.amp.state_dict(), **position},
                                      self.strategy.checkpoint_own(), "checkpoint_own")
            if self.detached:  # the coordinator writes the file once every worker sent its part
                self._report("checkpoint", own=to_cpu(own))
                self.saved_at = self.state.step
                return
            ranks = self.comm.gather_objects(to_cpu(own))
            if self.is_main:
                payload = {"config": self.cfg.to_dict(), "global_batch": self.plan.global_batch,
                           "world_size": self.world, "progress": run["progress"],
                           "scheduler": self.scheduler.state_dict(), "ranks": ranks,
                           EVAL_MODEL: to_cpu(self.strategy.eval_module.state_dict())}
                shared = to_cpu(self.strategy.checkpoint_shared())
                save_checkpoint(self.cfg.checkpoint_path, self._with_strategy(
                    payload, shared, "checkpoint_shared", reserved=CHECKPOINT_HEADER))
        self.saved_at = self.state.step

    def _with_strategy(self, ours: dict[str, Any], theirs: dict[str, Any], hook: str,
                       reserved: tuple[str, ...] = ()) -> dict[str, Any]:
        """The trainer's part of a checkpoint and the strategy's, which must not overwrite it
        (nor the ``reserved`` keys)."""
        if clash := sorted((ours.keys() | set(reserved)) & theirs.keys()):
            raise ShoalError(f"strategy {self.cfg.strategy}: {hook}() returns {clash[0]!r}, "
                             "a checkpoint key of the trainer's; rename it")
        return {**ours, **theirs}

    def _resume(self, strategy_cls: type[Strategy]) -> None:
        """Rank 0 reads the checkpoint and sends it to all (errors reach every rank); each
        component puts back its part."""
        def read() -> dict[str, Any]:
            payload = load_checkpoint(self.cfg.resume_path)
            check_resume(payload, self.cfg, self.world, strategy_cls)
            return payload

        payload = self._read_on_main(read)
        ranks = payload["ranks"]
        own = ranks[self.rank] if self.rank < len(ranks) else None
        if own is not None or not self.detached:  # a worker lost before its first checkpoint
            self.strategy.restore_checkpoint(payload, own)  # starts afresh from the servers
        # Replicas in sync scale their losses alike: a rank the checkpoint has no state of
        # takes the first rank's scaler.
        mine = own if own is not None else next((r for r in ranks if r), None)
        self.amp.load_state_dict(mine.get("precision") if mine else None)
        # A detached worker's position is its own (an older checkpoint's: the shared one).
        position = own if self.detached and own is not None and "progress" in own else payload
        self.scheduler.load_state_dict(position["scheduler"])
        self.state.load_state_dict({"progress": position["progress"], "rank": own})
        self.recorder.load_state_dict(own)

    def _read_on_main(self, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``read()`` on rank 0, its result (or its one-line error) sent to every rank;
        detached workers, which share no group, each read for themselves."""
        result, error = None, None
        if self.is_main or self.detached:
            try:
                result = read()
            except ShoalError as exc:
                result, error = None, str(exc)
        if not self.detached:
            result, error = self.comm.broadcast_object((result, error))
        if error:
            raise ShoalError(error)
        return result

    def _init_from(self) -> dict[str, Any]:
        """``--init-from``: rank 0 reads the checkpoint and sends all ranks its evaluation
        model (loaded here, before the strategy copies the model), position and epoch sums
        (detached workers read it themselves)."""
        def read() -> dict[str, Any]:
            payload = load_checkpoint(Path(self.cfg.init_from))
            check_init(payload, self.cfg, self.world)
            sums = [r["epoch_sums"] for r in payload["ranks"] if r is not None]
            return {"model": eval_model(payload), "progress": payload["progress"],
                    "epoch_sums": [sum(v) for v in zip(*sums, strict=True)] or None}

        start = self._read_on_main(read)
        load_eval_model(self.model, {EVAL_MODEL: start["model"]}, self.cfg.init_from)
        return start

    def _go_on_from(self, start: dict[str, Any]) -> None:
        """``--init-progress``: the position (step, epoch: the data order), the schedule at
        that step (with this run's rate) and the epoch's sums so far (all ranks', counted
        once, on rank 0); the optimizer and strategy start fresh."""
        progress = start["progress"]
        self.state.load_state_dict({"progress": progress, "rank": None})
        schedule_at(self.scheduler, progress["step"])
        if self.rank == 0 and start["epoch_sums"] is not None:
            self.recorder.load_state_dict({"epoch_sums": start["epoch_sums"]})

    def _check_finite(self, what: str) -> None:
        bad = any(not torch.isfinite(p).all() for p in self.strategy.eval_module.parameters())
        if self.comm.reduce_values([float(bad)], "max")[0]:
            raise ShoalError(f"parameters became non-finite by step {self.state.step}; "
                             f"{what} (lower --lr?)")
