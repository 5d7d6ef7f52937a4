"""The training loop: one epoch after another, every step through the chosen strategy.

Runs the same in every worker process; ranks appear only through the :class:`Comm` (which
rows of the data this worker reads, and who writes files). Each step is timed into data,
compute, communication, waiting, optimizer and the loop's own bookkeeping.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.processes import stop_requested
from shoal.core.timeline import CATEGORIES as TIME_CATEGORIES
from shoal.core.timeline import Timeline, chrome_trace, comm_fraction, time_fractions, time_split
from shoal.data import DataOptions, Dataset, EpochPlan, Split, load_dataset, shard_range
from shoal.data.augment import flip_and_crop
from shoal.errors import ShoalError
from shoal.models import build_model, count_parameters
from shoal.strategies import Strategy, get_strategy, make_options
from shoal.train.checkpoint import (
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
    to_cpu,
)
from shoal.train.metrics import MetricsLog, TensorBoardLog, require_tensorboard, write_json, write_trace
from shoal.train.optim import build_optimizer, build_schedule
from shoal.train.progress import Progress

#: Configuration keys that must match between a checkpoint and the run resuming it.
RESUME_KEYS = ("model", "dataset", "strategy", "seed", "optimizer", "lr", "momentum",
               "nesterov", "weight_decay", "scale_lr", "schedule", "warmup_epochs",
               "lr_milestones", "lr_gamma", "augment")


def data_options(cfg: TrainConfig) -> DataOptions:
    return DataOptions(cfg.data_dir, cfg.seed, tuple(cfg.synthetic_shape), cfg.synthetic_classes,
                       cfg.synthetic_samples, cfg.image_size)


def check_resume(payload: dict[str, Any], cfg: TrainConfig, world: int,
                 strategy_cls: type[Strategy]) -> None:
    """Raise a one-line error if ``payload`` cannot continue under ``cfg`` on ``world`` ranks."""
    saved, now = payload["config"], cfg.to_dict()
    for key in RESUME_KEYS:
        if saved.get(key) != now[key]:
            flag = "--" + key.replace("_", "-")
            raise ShoalError(f"checkpoint was made with {flag} {saved.get(key)!r}, "
                             f"this run has {flag} {now[key]!r}")
    step = payload["progress"]["step"]
    if cfg.stop_at_step is not None and cfg.stop_at_step <= step:
        raise ShoalError(f"--stop-at-step {cfg.stop_at_step} is not after the checkpoint's step "
                         f"{step}; nothing would be trained")
    if payload["global_batch"] != cfg.global_batch(world):
        raise ShoalError(f"checkpoint was made with a global batch of {payload['global_batch']}, "
                         f"this run has {cfg.global_batch(world)}")
    saved_opts = asdict(make_options(strategy_cls, saved.get("strategy_options") or {}))
    for key, value in asdict(make_options(strategy_cls, cfg.strategy_options)).items():
        if saved_opts.get(key) != value:
            flag = "--" + key.replace("_", "-")
            raise ShoalError(f"checkpoint was made with {flag} {saved_opts.get(key)}, "
                             f"this run has {flag} {value}")
    if not strategy_cls.replicas_in_sync and len(payload["ranks"]) != world:
        raise ShoalError(f"checkpoint holds {len(payload['ranks'])} workers' state; strategy "
                         f"{cfg.strategy} must resume on as many, not {world}")


def preflight(cfg: TrainConfig, world: int) -> Dataset:
    """Everything that can be checked before workers start: data, model fit, strategy
    options, output directory and resume file. Returns the loaded dataset."""
    strategy_cls = get_strategy(cfg.strategy)
    options = make_options(strategy_cls, cfg.strategy_options, world)
    if cfg.tensorboard:
        require_tensorboard()
    data = load_dataset(cfg.dataset, data_options(cfg))
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    # A strategy alone (no other ranks) checks how it fits the model and optimizer.
    strategy_cls(model, build_optimizer(cfg, model.parameters(), cfg.base_lr(world)),
                 Comm(Environment(), torch.device("cpu")), options)
    EpochPlan(len(data.train), cfg.global_batch(world), world, cfg.seed)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ShoalError(f"--out {out} exists and is not a directory")
    holds_run = any((out / f).exists() for f in ("checkpoint.pt", "metrics.jsonl"))
    if cfg.resume_path is not None:
        check_resume(load_checkpoint(cfg.resume_path), cfg, world, strategy_cls)
        if holds_run and not resumes_in_place(cfg):
            raise ShoalError(f"--out {out} already holds another run; resuming "
                             f"{cfg.resume_path} there would replace it: choose a new --out")
    elif not cfg.overwrite and holds_run:
        raise ShoalError(f"{out} already holds a run; pass --resume to continue it or "
                         "--overwrite to start over")
    return data


def resumes_in_place(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` resumes the run in its own ``--out`` (not a checkpoint from elsewhere)."""
    resume = cfg.resume_path
    return resume is not None and resume.resolve() == cfg.checkpoint_path.resolve()


@dataclass
class RunState:
    """Where training is, and what has been accumulated; saved in checkpoints."""

    epoch: int = 0  # epochs completed
    epoch_step: int = 0  # steps completed in the current epoch
    step: int = 0  # steps completed in all
    samples: int = 0  # training samples processed, all ranks
    train_time_s: float = 0.0  # rank 0's time inside training steps
    wall_time_s: float = 0.0  # earlier invocations' wall time
    times: dict[str, float] = field(default_factory=dict)  # this rank's time per category
    bytes_sent: int = 0  # this rank's payload
    epoch_sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss, correct, n


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
        self.out = Path(cfg.out)
        self.data = data if data is not None else load_dataset(cfg.dataset, data_options(cfg))
        self.plan = EpochPlan(len(self.data.train), cfg.global_batch(self.world), self.world,
                              cfg.seed)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.model = build_model(cfg.model, self.data.input_shape,
                                 self.data.num_classes).to(self.device)
        self.optimizer = build_optimizer(cfg, self.model.parameters(), cfg.base_lr(self.world))
        self.scheduler = build_schedule(cfg, self.optimizer, self.plan.steps_per_epoch)
        torch.manual_seed(cfg.seed + 1 + self.rank)  # dropout differs between ranks
        self.aug_gen = torch.Generator().manual_seed(cfg.seed + 10_007 * (self.rank + 1))
        self.state = RunState()
        self._lr = self.optimizer.param_groups[0]["lr"]  # the rate the last step used
        strategy_cls = get_strategy(cfg.strategy)
        # Every strategy starts all workers from rank 0's model; a resumed run then puts back
        # what each worker had.
        self.strategy = strategy_cls(self.model, self.optimizer, comm,
                                     make_options(strategy_cls, cfg.strategy_options))
        if cfg.resume_path is not None:
            self._restore(self._load_resume(strategy_cls))
        self.progress = Progress(cfg.progress, enabled=self.is_main)
        self.log: MetricsLog | None = None
        # SIGTERM (processes.stop_requested) stops every rank after the same step: they vote
        # in a tiny all-reduce on a Gloo group of its own, at the strategy's own meeting
        # points (every tau steps for the periodic ones, so it adds no coupling), and act on
        # a vote one meeting later, so nobody waits for it.
        self.stop_reason: str | None = None
        self._vote_every = int(getattr(self.strategy.options, "tau", 1) or 1)
        self._vote: tuple[Any, torch.Tensor] | None = None
        self._vote_group = dist.new_group(backend="gloo") if comm.active else None

    # -- checkpoints --------------------------------------------------------------------------
    def _load_resume(self, strategy_cls: type[Strategy]) -> dict[str, Any]:
        """Rank 0 reads the checkpoint and sends it to all; errors reach every rank."""
        payload, error = None, None
        if self.is_main:
            try:
                payload = load_checkpoint(self.cfg.resume_path)
                check_resume(payload, self.cfg, self.world, strategy_cls)
            except ShoalError as exc:
                payload, error = None, str(exc)
        payload, error = self.comm.broadcast_object((payload, error))
        if error:
            raise ShoalError(error)
        mine = payload["ranks"][self.rank] if self.rank < len(payload["ranks"]) else None
        in_sync = strategy_cls.replicas_in_sync
        self.model.load_state_dict(payload["model"] if in_sync else mine["model"])
        self.optimizer.load_state_dict(payload["optimizer"] if in_sync else mine["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        return payload

    def _restore(self, payload: dict[str, Any]) -> None:
        p = payload["progress"]
        self.state = RunState(
            epoch=p["epoch"], epoch_step=p["epoch_step"], step=p["step"], samples=p["samples"],
            train_time_s=p["train_time_s"], wall_time_s=p["wall_time_s"],
        )
        # The rate of the step before the checkpoint: the epoch record that may follow at
        # once (a checkpoint at an epoch's last step) reports it.
        self._lr = p.get("lr", self.optimizer.param_groups[0]["lr"])
        if self.rank < len(payload["ranks"]):
            mine = payload["ranks"][self.rank]
            torch.set_rng_state(mine["rng"])
            self.aug_gen.set_state(mine["aug_rng"])
            if self.device.type == "cuda" and "cuda_rng" in mine:
                torch.cuda.set_rng_state(mine["cuda_rng"])
            self.strategy.load_state_dict(mine["strategy"])
            self.state.times = dict(mine["times"])
            self.state.bytes_sent = int(mine["bytes_sent"])
            self.state.epoch_sums = list(mine["epoch_sums"])
        self.comm.bytes_sent = self.state.bytes_sent
        self.tl.totals.update(self.state.times)

    def _check_finite(self, what: str) -> None:
        bad = any(not torch.isfinite(p).all() for p in self.strategy.eval_module.parameters())
        if self.comm.reduce_values([float(bad)], "max")[0]:
            raise ShoalError(f"parameters became non-finite by step {self.state.step}; "
                             f"{what} (lower --lr?)")

    def save(self) -> None:
        """Write ``checkpoint.pt`` atomically (rank 0), with every rank's own state."""
        self._check_finite("checkpoint not written, the last good one is kept")
        with self.tl.span("checkpoint"):
            self._sync_state()
            local: dict[str, Any] = {
                "rng": torch.get_rng_state(),
                "aug_rng": self.aug_gen.get_state(),
                "strategy": self.strategy.state_dict(),
                "times": dict(self.state.times),
                "bytes_sent": self.state.bytes_sent,
                "epoch_sums": self._epoch_sums(),
            }
            if self.device.type == "cuda":
                local["cuda_rng"] = torch.cuda.get_rng_state()
            if not self.strategy.replicas_in_sync:
                local["model"] = self.model.state_dict()
                local["optimizer"] = self.optimizer.state_dict()
            ranks = self.comm.gather_objects(to_cpu(local))
            if self.is_main:
                s = self.state
                save_checkpoint(self.cfg.checkpoint_path, {
                    "config": self.cfg.to_dict(),
                    "global_batch": self.plan.global_batch,
                    "world_size": self.world,
                    "progress": {
                        "epoch": s.epoch, "epoch_step": s.epoch_step, "step": s.step,
                        "samples": s.samples, "train_time_s": s.train_time_s,
                        "wall_time_s": s.wall_time_s + (time.perf_counter() - self._t0),
                        "lr": self._lr,
                    },
                    "model": to_cpu(self.strategy.eval_module.state_dict()),
                    "optimizer": to_cpu(self.optimizer.state_dict()),
                    "scheduler": self.scheduler.state_dict(),
                    "ranks": ranks,
                })

    # -- one step -----------------------------------------------------------------------------
    def _sync_state(self) -> None:
        self.state.times = {k: v for k, v in self.tl.totals.items() if k in TIME_CATEGORIES}
        self.state.bytes_sent = self.comm.bytes_sent

    def _batch(self, split: Split, idx: torch.Tensor, train: bool) -> tuple[torch.Tensor, ...]:
        x, y = split.get_batch(idx)
        if train and self.cfg.augment:
            x = flip_and_crop(x, self.aug_gen)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step(self, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """One step: returns (loss sum, correct, local samples, global samples) of the batch."""
        tl, strategy = self.tl, self.strategy
        with tl.span("data"):
            idx, n_global = self.plan.local(perm, self.state.epoch_step, self.rank)
            x, y = self._batch(self.data.train, idx, train=True)
        with tl.span("compute"):
            out = strategy.module(x)
            loss = F.cross_entropy(out, y)
            strategy.batch_share = (len(idx), n_global)
            strategy.backward(loss)
        with tl.span("optim"):
            self._lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
            strategy.step()
            self.scheduler.step()
            strategy.zero_grad()
        with torch.no_grad():
            correct = (out.argmax(1) == y).sum()
        return loss.detach() * len(idx), correct, len(idx), n_global

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Test loss and accuracy of the strategy's evaluation model; each rank a shard."""
        model: nn.Module = self.strategy.eval_module
        was_training = model.training
        model.eval()
        test = self.data.test
        lo, hi = shard_range(len(test), self.world, self.rank)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        batch = max(256, 2 * self.cfg.batch_size)
        for start in range(lo, hi, batch):
            x, y = self._batch(test, torch.arange(start, min(start + batch, hi)), train=False)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").double()
            correct += (out.argmax(1) == y).sum()
        model.train(was_training)
        total_loss, total_correct = self.comm.reduce_values([loss_sum.item(), correct.item()])
        return total_loss / len(test), total_correct / len(test)

    # -- the loop -----------------------------------------------------------------------------
    def _log_step(self, loss_sum: float, correct: float, n: int, samples: int,
                  times: dict[str, float]) -> None:
        if not math.isfinite(loss_sum):
            raise ShoalError(f"training loss became {loss_sum / max(n, 1)} by step "
                             f"{self.state.step} (epoch {self.state.epoch + 1}); "
                             "lower --lr or check the data")
        if self.log is None:
            return
        step_time = sum(times.values())
        self.log.write({
            "event": "step", "epoch": self.state.epoch + 1, "step": self.state.step,
            "loss": loss_sum / n, "accuracy": correct / n,
            "lr": self._lr,
            "samples_per_s": samples / step_time if step_time > 0 else None,
            "time_s": time_split(times), "comm_fraction": comm_fraction(times),
            "bytes_sent": self.comm.bytes_sent,
            "elapsed_s": self.state.wall_time_s + time.perf_counter() - self._t0,
        })

    def _stop_agreed(self) -> bool:
        """Whether all ranks stop after this step (SIGTERM reached one of them)."""
        if self._vote_group is None:
            return stop_requested()
        if self.state.step % self._vote_every:
            return False
        agreed = False
        if self._vote is not None:
            work, flag = self._vote
            work.wait()
            agreed = flag.item() > 0
        flag = torch.tensor([1.0 if stop_requested() else 0.0])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._vote_group, async_op=True)
        self._vote = (work, flag)
        return agreed

    def _settle_vote(self) -> None:
        """Finish the vote in flight (every rank started the same ones) before leaving."""
        if self._vote is not None:
            self._vote[0].wait()
            self._vote = None

    def _epoch_sums(self) -> list[float]:
        """This rank's (loss sum, correct, samples) of the epoch so far."""
        return [a + b for a, b in zip(self.state.epoch_sums, self._epoch_acc.tolist(), strict=False)]

    def run(self) -> dict[str, Any] | None:
        """Train to ``cfg.epochs`` (or ``cfg.stop_at_step``); rank 0 returns the summary."""
        cfg, st, tl, plan = self.cfg, self.state, self.tl, self.plan
        self._t0 = time.perf_counter()
        self._epoch_acc = torch.zeros(3, dtype=torch.float64, device=self.device)
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.out)
            (self.out / "summary.json").unlink(missing_ok=True)  # rewritten at the end
            write_json(self.out / "config.json", {**cfg.to_dict(), "world_size": self.world})
            resumed_at = st.step if cfg.resume_path else None
            board = TensorBoardLog(self.out / "tensorboard", resumed_at) if cfg.tensorboard else None
            seed = None if resumed_at is None or resumes_in_place(cfg) else \
                cfg.resume_path.parent / "metrics.jsonl"
            self.log = MetricsLog(self.out / "metrics.jsonl", keep_until_step=resumed_at,
                                  tensorboard=board, history=seed)
            self.progress.line(
                f"shoal: {cfg.model} on {self.data.describe()}; {self.world} worker(s), "
                f"strategy {cfg.strategy}, global batch {plan.global_batch}, "
                f"{plan.steps_per_epoch} steps/epoch")
        self._profiler: Any = None
        stopped = False
        saved_at = -1
        test_loss = test_acc = float("nan")
        while st.epoch < cfg.epochs and not stopped:
            perm = plan.permutation(st.epoch)
            self.strategy.module.train()
            self.progress.start_epoch(st.epoch + 1, cfg.epochs, plan.steps_per_epoch, st.epoch_step)
            epoch_start = interval_start = tl.snapshot()
            interval = torch.zeros(3, dtype=torch.float64, device=self.device)
            interval_samples = epoch_samples = 0
            while st.epoch_step < plan.steps_per_epoch:
                if cfg.profile is not None and st.step + 1 == cfg.profile[0]:
                    self._start_profiler()
                t_step = time.perf_counter()
                with tl.span("other", "step"):
                    loss_sum, correct, n, n_global = self.train_step(perm)
                    sums = torch.stack([loss_sum.double(), correct.double(),
                                        torch.tensor(float(n), dtype=torch.float64,
                                                     device=self.device)])
                    interval += sums
                    self._epoch_acc += sums
                st.train_time_s += time.perf_counter() - t_step
                st.step += 1
                st.epoch_step += 1
                if self._profiler is not None:
                    self._profiler.step()
                    if st.step >= cfg.profile[1]:
                        self._stop_profiler()
                st.samples += n_global
                interval_samples += n_global
                epoch_samples += n_global
                if st.step % cfg.log_every == 0 or st.epoch_step == plan.steps_per_epoch:
                    now = tl.snapshot()
                    ls, co, cnt = interval.tolist()
                    self._log_step(ls, co, int(cnt), interval_samples,
                                   self._step_times(Timeline.delta(now, interval_start)))
                    self.progress.step(ls / cnt)
                    interval.zero_()
                    interval_samples, interval_start = 0, now
                else:
                    self.progress.step()
                if cfg.stop_at_step is not None and st.step >= cfg.stop_at_step:
                    stopped = True
                    break
                if self._stop_agreed():
                    stopped, self.stop_reason = True, "SIGTERM"
                    break
                if cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0:
                    self.save()
                    saved_at = st.step
            self.progress.end_epoch()
            if stopped:
                break
            self.strategy.end_epoch(st.epoch)
            loss_all, correct_all, n_all = self.comm.reduce_values(self._epoch_sums())
            self._epoch_acc.zero_()
            st.epoch, st.epoch_step, st.epoch_sums = st.epoch + 1, 0, [0.0, 0.0, 0.0]
            if st.epoch % cfg.eval_every == 0 or st.epoch == cfg.epochs:
                with tl.span("eval"):
                    test_loss, test_acc = self.evaluate()
            self._end_epoch_record(loss_all / n_all, correct_all / n_all, test_loss, test_acc,
                                   epoch_samples,
                                   self._step_times(Timeline.delta(tl.snapshot(), epoch_start)))
            if not cfg.checkpoint_every:
                self.save()
                saved_at = st.step
        self._stop_profiler()
        self._settle_vote()
        if saved_at != st.step:
            self.save()
        if not stopped and math.isnan(test_acc):
            test_loss, test_acc = self.evaluate()
        return self._finish(stopped, test_loss, test_acc)

    # -- profiling and tracing ----------------------------------------------------------------
    def _start_profiler(self) -> None:
        """Hand the steps of ``--profile FIRST:LAST`` to torch.profiler (every rank)."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()
        self._profiled_from = self.state.step + 1

    def _stop_profiler(self) -> None:
        if self._profiler is None:
            return
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        path = self.out / "profile" / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if self.is_main:
            self.progress.line(f"profiled steps {self._profiled_from}-{self.state.step} into "
                               f"{path.parent}/rank*.json")

    def _write_trace(self) -> None:
        """Gather every rank's spans to rank 0 and write ``trace.json`` (one lane per rank)."""
        lanes = self.comm.gather_objects(self.tl.chrome_events(self.rank))
        if self.is_main:
            assert lanes is not None
            write_trace(self.out / "trace.json", chrome_trace(lanes, {
                "model": self.cfg.model, "strategy": self.cfg.strategy,
                "workers": self.world, "steps": self.state.step}))

    @staticmethod
    def _step_times(times: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in times.items() if k in TIME_CATEGORIES}

    def _end_epoch_record(self, train_loss: float, train_acc: float, test_loss: float,
                          test_acc: float, samples: int, times: dict[str, float]) -> None:
        self._last_train = (train_loss, train_acc)
        if not math.isfinite(train_loss):
            raise ShoalError(f"training loss became {train_loss} in epoch {self.state.epoch}; "
                             "lower --lr or check the data")
        if not self.is_main:
            return
        step_times = times
        step_time = sum(step_times.values())
        assert self.log is not None
        self.log.write({
            "event": "epoch", "epoch": self.state.epoch, "step": self.state.step,
            "train_loss": train_loss, "train_accuracy": train_acc,
            "test_loss": test_loss, "test_accuracy": test_acc,
            "lr": self._lr,
            "samples_per_s": samples / step_time if step_time > 0 else None,
            "time_s": time_split(step_times), "comm_fraction": comm_fraction(step_times),
            "bytes_sent": self.comm.bytes_sent,
            "elapsed_s": self.state.wall_time_s + time.perf_counter() - self._t0,
        })
        test = f"  test loss {test_loss:.4f} acc {100 * test_acc:.1f}%" \
            if math.isfinite(test_acc) else ""
        self.progress.line(
            f"epoch {self.state.epoch:>3}/{self.cfg.epochs}  train loss {train_loss:.4f} "
            f"acc {100 * train_acc:.1f}%{test}  {samples / max(step_time, 1e-9):,.0f} samples/s"
            f"  comm {100 * comm_fraction(step_times):.0f}%")

    def _finish(self, stopped: bool, test_loss: float, test_acc: float) -> dict[str, Any] | None:
        st = self.state
        self._sync_state()
        keys = list(TIME_CATEGORIES)
        summed = self.comm.reduce_values([st.times.get(k, 0.0) for k in keys]
                                         + [float(self.comm.bytes_sent)])
        times = {k: v / self.world for k, v in zip(keys, summed[:-1], strict=False)}
        total_bytes = summed[-1]
        if self.cfg.trace:
            self._write_trace()
        if self.log is not None:
            self.log.close()
        if not self.is_main:
            return None
        train_loss, train_acc = getattr(self, "_last_train", (float("nan"), float("nan")))
        wall = st.wall_time_s + time.perf_counter() - self._t0
        summary = {
            "model": self.cfg.model, "dataset": self.cfg.dataset, "strategy": self.cfg.strategy,
            "strategy_options": self.cfg.strategy_options,
            "workers": self.world, "device": str(self.device),
            "global_batch": self.plan.global_batch, "epochs": st.epoch, "steps": st.step,
            "completed": not stopped and st.epoch >= self.cfg.epochs,
            "stopped_by": self.stop_reason,
            "test_accuracy": test_acc, "test_loss": test_loss,
            "train_loss": train_loss, "train_accuracy": train_acc,
            "wall_time_s": wall, "train_time_s": st.train_time_s, "samples": st.samples,
            "samples_per_s": st.samples / st.train_time_s if st.train_time_s > 0 else None,
            "comm_fraction": comm_fraction(times),
            "wait_fraction": time_fractions(times)["wait"],
            "time_s": time_split(times), "time_fraction": time_fractions(times),
            "step_time_s": sum(times.values()) / st.step if st.step else None,
            "bytes_sent": total_bytes,
            "bytes_per_sample": total_bytes / st.samples if st.samples else None,
            "parameters": count_parameters(self.model),
            "torch_version": torch.__version__, "shoal_version": shoal.__version__,
        }
        write_json(self.out / "summary.json", summary)
        if self.stop_reason:
            self.progress.line(f"stopped by {self.stop_reason} at step {st.step}; checkpoint in "
                               f"{self.cfg.checkpoint_path} (continue with --resume)")
        elif stopped:
            self.progress.line(f"stopped at step {st.step} as asked; checkpoint in "
                               f"{self.cfg.checkpoint_path} (continue with --resume)")
        else:
            self.progress.line(f"done: test accuracy {100 * test_acc:.2f}% after {st.epoch} "
                               f"epochs in {wall:.1f} s; results in {self.out}")
        return summary
