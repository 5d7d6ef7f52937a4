"""What a run shows and leaves behind: :class:`Recorder`.

The trainer tells the recorder what happened (a step, an epoch, the end); the recorder keeps
the running sums, writes ``metrics.jsonl`` (and TensorBoard), the progress lines or bar,
``summary.json``, the Chrome trace (``--trace``) and the ``torch.profiler`` window
(``--profile``), so the loop itself reads as the story of a run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.files import remove_stale_temporaries
from shoal.core.ops import values_by_rank
from shoal.core.timeline import (
    CATEGORIES,
    COMM,
    DATA,
    WAIT,
    Timeline,
    chrome_trace,
    comm_fraction,
    step_times,
    time_fractions,
    time_split,
)
from shoal.data import EpochPlan
from shoal.strategies import get_strategy, settings_of
from shoal.train.checkpoint import resumes_in_place
from shoal.train.evaluation import Evaluator
from shoal.train.health import Health
from shoal.train.membership.changes import MembershipChange, records
from shoal.train.optim import describe_momentum
from shoal.train.progress import Progress
from shoal.train.records import MetricsLog, TensorBoardLog, write_json, write_trace
from shoal.train.state import RunState
from shoal.version import __version__

#: A data share of the step time above this: the input pipeline does not keep up.
INPUT_BOUND = 0.25


def input_bound(times: dict[str, float]) -> str:
    """``  data 61%: input-bound (...)`` when reading batches took more than
    :data:`INPUT_BOUND` of the step time ``times``, else nothing."""
    share = times.get(DATA, 0.0) / max(sum(times.values()), 1e-9)
    if share <= INPUT_BOUND:
        return ""
    return f"  data {100 * share:.0f}%: input-bound (see --loader-workers)"


class Recorder:
    """One worker's records: every rank keeps sums and checks the loss; rank 0 writes.
    ``evaluator``: whose testing time the records report (``eval_s``)."""

    #: Whether rank 0 writes (a subclass that reports its records elsewhere does not).
    writes = True

    def __init__(self, cfg: TrainConfig, comm: Comm, plan: EpochPlan,
                 evaluator: Evaluator | None = None, *, classes: int) -> None:
        self.cfg, self.comm, self.plan = cfg, comm, plan
        self._samples = plan.n  # an epoch's (the plan may come to hold an epoch's rest)
        #: Whether the run learns (non-finite loss, collapse): ``classes`` is the data's C.
        self.health = Health(classes, cfg.allow_collapse)
        self.tl = comm.timeline
        self.evaluator = evaluator
        self.out = Path(cfg.out)
        self.progress = Progress(cfg.progress, enabled=self.is_main)
        self.log: MetricsLog | None = None  # rank 0's, from :meth:`begin`
        self._data: str | None = None  # the data set's description, from :meth:`begin`
        self._first_step = 0  # the step this invocation began at
        # This rank's (loss sum, correct, samples): of the epoch (checkpointed, see
        # :meth:`state_dict`), and since the last step record.
        self._epoch_sums = torch.zeros(3, dtype=torch.float64, device=comm.device)
        self._interval_sums = torch.zeros(3, dtype=torch.float64, device=comm.device)
        # All ranks' samples and the timeline's totals at the start of each, this invocation.
        self._epoch_samples = self._interval_samples = 0
        self._epoch_start: dict[str, float] = {}
        self._interval_start: dict[str, float] = {}
        self.last_train = (float("nan"), float("nan"))  # the last epoch's loss and accuracy
        self._profiler: Any = None  # torch.profiler.profile, inside the --profile window
        self._profiled_from = 0
        #: ``--elastic``: the membership changes so far (summary.json's, once set).
        self.changes: list[MembershipChange] | None = None

    @property
    def is_main(self) -> bool:
        """Whether this rank writes the records: the group's rank 0, which in an elastic
        job that lost worker 0 is the lowest id left (:meth:`take_over`)."""
        return self.writes and self.comm.rank == 0

    def take_over(self, st: RunState) -> None:
        """Elastic, after the group was re-formed: a worker that became rank 0 because
        worker 0 was lost writes the records from here on. Before any step of this
        invocation it begins them afresh (worker 0 may have been lost in :meth:`begin`);
        after, or in a joiner (the job's records go back before it), it appends to
        ``metrics.jsonl`` as worker 0 left it: the records up to the last step all counted
        (``st.step``), a torn last line dropped."""
        m = self.comm.membership
        if not self.is_main or self.log is not None or self._data is None or m is None:
            return
        self.progress = Progress(self.cfg.progress, enabled=True)
        if st.step == self._first_step and m.me < m.first_world:
            self._open(st, self._data)
        else:
            board = TensorBoardLog(self.out / "tensorboard", st.step) \
                if self.cfg.tensorboard else None
            self.log = MetricsLog(self.out / "metrics.jsonl", keep_until_step=st.step,
                                  tensorboard=board)

    @property
    def eval_s(self) -> float:
        """Seconds this invocation spent testing (in the records: ``eval_s``)."""
        return self.evaluator.eval_s if self.evaluator is not None else 0.0

    # -- checkpoints: the epoch's sums so far -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch_sums": self._epoch_sums.tolist()}

    def epoch_sums(self) -> list[float]:
        """This rank's (loss sum, correct, samples) of the epoch so far."""
        return self._epoch_sums.tolist()

    def load_state_dict(self, own: dict[str, Any] | None) -> None:
        """``own``: this rank's part of a checkpoint, ``None`` where it has none."""
        if own is not None:
            self._epoch_sums = torch.tensor(own["epoch_sums"], dtype=torch.float64,
                                            device=self.comm.device)

    # -- the run ------------------------------------------------------------------------------
    def begin(self, st: RunState, data: str) -> None:
        """Open the output directory and ``metrics.jsonl`` (resumed: cut at the checkpoint's
        step) and say what runs; ``data`` describes the data set."""
        self._data, self._first_step = data, st.step
        if self.is_main:
            self._open(st, data)

    def _open(self, st: RunState, data: str) -> None:
        """:meth:`begin` on the rank that writes."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.out)
        (self.out / "summary.json").unlink(missing_ok=True)  # rewritten at the end
        settings = settings_of(get_strategy(cfg.strategy), cfg.strategy_options,
                               self.comm.world_size)
        write_json(self.out / "config.json", {**cfg.to_dict(), "world_size": self.comm.world_size,
                                              "strategy_settings": settings})
        source = cfg.continues_from  # --resume, or --init-from with --init-progress
        resumed_at = st.step if source is not None else None
        board = TensorBoardLog(self.out / "tensorboard", resumed_at) if cfg.tensorboard else None
        history = None if source is None or resumes_in_place(cfg) else \
            source.parent / "metrics.jsonl"
        self.log = MetricsLog(self.out / "metrics.jsonl", keep_until_step=resumed_at,
                              tensorboard=board, history=history)
        world, plan = self.comm.world_size, self.plan
        if plan.order is not None or (self.comm.membership is not None and plan.world != world):
            # lost at the start, or resumed with the epoch's rest dealt anew
            plan = EpochPlan(self._samples, cfg.global_batch(world), world, cfg.seed)
        shown = ", ".join(f"{k} {v:g}" for k, v in settings.items())
        shown = f" ({shown})" if shown else ""
        self.progress.line(
            f"shoal: {cfg.model} on {data}; {world} worker(s), strategy {cfg.strategy}{shown}, "
            f"global batch {plan.global_batch}, {plan.steps_per_epoch} steps/epoch; {describe_momentum(cfg)}")

    def start_clock(self, st: RunState) -> None:
        """Start the run's clock (its records' ``elapsed_s``) once every rank is here, at a
        barrier: every strategy's clock starts when all its workers can train, an
        asynchronous run's coordinator's too (:mod:`.coordinator`), so that one rank's
        slow start-up is no strategy's time to accuracy."""
        self.comm.barrier(booked=False)  # before the clock: no training time
        st.start()

    def start_epoch(self, st: RunState) -> None:
        self.progress.start_epoch(st.epoch + 1, self.cfg.epochs, self.plan.steps_per_epoch,
                                  st.epoch_step)
        self._epoch_start = self._interval_start = self.tl.snapshot()
        self._interval_sums.zero_()
        self._epoch_samples = self._interval_samples = 0

    def before_step(self, st: RunState) -> None:
        """Open the profiler when the next step is the first of ``--profile``."""
        if self.cfg.profile is not None and st.step + 1 == self.cfg.profile[0]:
            self._start_profiler(st.step + 1)

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, n: int) -> None:
        """Count a step's loss sum, correct predictions and samples (this rank's)."""
        sums = torch.stack([loss_sum.double(), correct.double(),
                            torch.tensor(float(n), dtype=torch.float64, device=self.comm.device)])
        self._interval_sums += sums
        self._epoch_sums += sums

    def before_update(self, loss_sum: torch.Tensor, st: RunState) -> None:
        """A step's loss before its update leaves this rank: nothing to do here (a
        synchronous rank's update meets its peers' in the same step, and :meth:`step`
        checks the loss after it). A detached worker checks it here (:mod:`.remote`)."""

    def _check_due(self, step: int, epoch_step: int) -> bool:
        """Whether the loss is checked after ``step`` (``epoch_step`` of its epoch): every
        step on the CPU; on a GPU, where a check waits for the device, at each record."""
        return (self.comm.device.type == "cpu" or step % self.cfg.log_every == 0
                or epoch_step == self.plan.steps_per_epoch)

    def told_to_stop(self, st: RunState) -> bool:
        """Whether a collapse stops the run after this step where the trainer's epoch loop
        would not see it (a detached worker's, :class:`~shoal.train.remote.RemoteRecorder`);
        here never."""
        return False

    def step(self, st: RunState, samples: int) -> None:
        """After a step of ``samples`` (all ranks): the profiler, the step record every
        ``--log-every`` steps and at the epoch's end, the progress bar."""
        if self._profiler is not None:
            self._profiler.step()
            if st.step >= self.cfg.profile[1]:
                self.stop_profiler(st)
        self._interval_samples += samples
        self._epoch_samples += samples
        due = st.step % self.cfg.log_every == 0 or st.epoch_step == self.plan.steps_per_epoch
        if self._check_due(st.step, st.epoch_step):
            self.health.check_loss(float(self._interval_sums[0]), st.step, st.epoch + 1, st.lr,
                                   self.cfg.checkpoint_path)
        if not due:
            self.progress.step()
            return
        now = self.tl.snapshot()
        loss_sum, correct, count = self._interval_sums.tolist()
        n = int(count)
        if self.log is not None:
            self.log.write(self._record(
                "step", st.epoch + 1, st, {"loss": loss_sum / n, "accuracy": correct / n},
                self._interval_samples, Timeline.delta(now, self._interval_start)))
        self.progress.step(loss_sum / count)
        self._interval_sums.zero_()
        self._interval_samples, self._interval_start = 0, now

    def end_steps(self) -> None:
        """The epoch's steps are over (or the run stops): close its progress bar."""
        self.progress.end_epoch()

    def epoch(self, st: RunState, test: tuple[float, float]) -> None:
        """After epoch ``st.epoch`` (and its evaluation, ``test`` loss and accuracy): the
        training loss and accuracy over all ranks, the epoch record and line."""
        loss_sum, correct, n = self.comm.reduce_values(self._epoch_sums.tolist())
        self._epoch_sums.zero_()
        train_loss, train_acc = self.last_train = (loss_sum / n, correct / n)
        self.health.check_loss(train_loss, st.step, st.epoch, st.lr, self.cfg.checkpoint_path)
        test_loss, test_acc = test
        collapse = self.health.epoch(st.epoch, train_loss, train_acc, test_acc)
        if not self.is_main:
            return
        times = step_times(Timeline.delta(self.tl.snapshot(), self._epoch_start))
        assert self.log is not None
        self.log.write(self._record(
            "epoch", st.epoch, st, {"train_loss": train_loss, "train_accuracy": train_acc,
                                    "test_loss": test_loss, "test_accuracy": test_acc},
            self._epoch_samples, times))
        shown = f"  test loss {test_loss:.4f} acc {100 * test_acc:.1f}%" \
            if math.isfinite(test_acc) else ""
        self.progress.line(
            f"epoch {st.epoch:>3}/{self.cfg.epochs}  train loss {train_loss:.4f} "
            f"acc {100 * train_acc:.1f}%{shown}  "
            f"{self._epoch_samples / max(sum(times.values()), 1e-9):,.0f} samples/s"
            f"  comm {100 * comm_fraction(times):.0f}%{input_bound(times)}")
        if collapse:
            self.progress.line(f"shoal: {collapse}")

    def evaluation(self, st: RunState, test: tuple[float, float],
                   samples: int | None = None) -> None:
        """A test inside an epoch (``--eval-every-steps``): the ``eval`` record, whose
        ``epoch`` is fractional (epochs done, with this one's share of steps) and whose
        ``samples`` are the training samples of all workers so far: ``st``'s, or those
        given (an asynchronous run's coordinator: its workers' own counts, summed; the
        epoch and step then follow from them)."""
        if not self.is_main:
            return
        assert self.log is not None
        test_loss, test_acc = test
        epoch, step = st.epoch + st.epoch_step / self.plan.steps_per_epoch, st.step
        if samples is not None:
            epoch, step = samples / self.plan.n, samples // self.plan.global_batch
        self.log.write({"event": "eval", "epoch": epoch, "step": step,
                        "samples": st.samples if samples is None else samples,
                        "test_loss": test_loss, "test_accuracy": test_acc,
                        "lr": st.lr, "eval_s": self.eval_s, "elapsed_s": st.elapsed_s()})

    def _record(self, event: str, epoch: int, st: RunState, metrics: dict[str, float],
                samples: int, totals: dict[str, float]) -> dict[str, Any]:
        """A step or epoch record: where the run is, ``metrics``, then what both kinds share
        (throughput of ``samples`` over the step time in ``totals``, its split, bytes)."""
        times = step_times(totals)
        step_time = sum(times.values())
        return {"event": event, "epoch": epoch, "step": st.step, **metrics, "lr": st.lr,
                "samples_per_s": samples / step_time if step_time > 0 else None,
                "time_s": time_split(times), "comm_fraction": comm_fraction(times),
                "bytes_sent": self.comm.bytes_sent, "eval_s": self.eval_s,
                "elapsed_s": st.elapsed_s(),
                **({"workers": self.comm.world_size} if self.cfg.elastic else {})}

    def finish(self, st: RunState, stopped: bool, stop_reason: str | None,
               test: tuple[float, float], parameters: int, extra: dict[str, Any] | None = None,
               lanes: list[Any] | None = None) -> dict[str, Any] | None:
        """The end: the time split and bytes over all ranks, the trace, ``summary.json`` and
        the last line. Rank 0 returns the summary, with ``extra`` at its end (the launcher's
        restarts, an asynchronous run's servers). ``lanes``: the trace's, else each rank's
        timeline."""
        totals = self.tl.totals
        ranks = values_by_rank(self.comm, [totals.get(k, 0.0) for k in CATEGORIES]
                                         + [float(self.comm.bytes_sent), float(self.comm.peak_in_flight)])
        world = self.comm.world_size  # an elastic job's, after the call
        times = {k: sum(r[i] for r in ranks) / world for i, k in enumerate(CATEGORIES)}
        total_bytes, peak = sum(r[-2] for r in ranks), max(r[-1] for r in ranks)
        by_rank = [time_fractions(dict(zip(CATEGORIES, r, strict=False))) for r in ranks] \
            if self.comm.active or world == 1 else []  # an asynchronous job's: summed already
        if self.cfg.trace:
            self._write_trace(st, lanes)
        if self.log is not None:
            self.log.close()
        if not self.is_main:
            return None
        cfg, (test_loss, test_acc), (train_loss, train_acc) = self.cfg, test, self.last_train
        wall = st.elapsed_s()
        fractions = time_fractions(times)
        summary = {
            "model": cfg.model, "dataset": cfg.dataset, "strategy": cfg.strategy,
            "strategy_options": cfg.strategy_options,
            "workers": world, "device": str(self.comm.device),
            "global_batch": self.plan.global_batch, "epochs": st.epoch, "steps": st.step,
            "completed": not stopped and st.epoch >= cfg.epochs,
            "stopped_by": stop_reason,
            "test_accuracy": test_acc, "test_loss": test_loss,
            "train_loss": train_loss, "train_accuracy": train_acc,
            "wall_time_s": wall, "train_time_s": st.train_time_s, "samples": st.samples,
            "samples_per_s": st.samples / st.train_time_s if st.train_time_s > 0 else None,
            "comm_fraction": comm_fraction(times),
            "wait_fraction": fractions[WAIT],
            # Each worker's own: blocked on its collectives (comm) and on slower ranks (wait).
            **({"comm_fraction_by_rank": [f[COMM] for f in by_rank],
                "wait_fraction_by_rank": [f[WAIT] for f in by_rank]} if by_rank else {}),
            "time_s": time_split(times), "time_fraction": fractions,
            "step_time_s": sum(times.values()) / st.step if st.step else None,
            "bytes_sent": total_bytes,
            "bytes_per_sample": total_bytes / st.samples if st.samples else None,
            "peak_bytes_in_flight": int(peak),
            "parameters": parameters,
            **({"momentum_auto": cfg.momentum_auto} if cfg.momentum_auto else {}),
            **({"lr_auto": cfg.lr_auto} if cfg.lr_auto else {}),
            **({"collapsed": verdict} if (verdict := self.health.verdict()) else {}),
            "torch_version": torch.__version__, "shoal_version": __version__,
            **({"membership_changes": records(self.changes)} if self.changes is not None else {}),
            **(extra or {}),
        }
        write_json(self.out / "summary.json", summary)
        self.progress.line(self.health.last_line(stopped, stop_reason, st.step, st.epoch, test_acc,
                                                 wall, cfg.checkpoint_path, self.out))
        return summary

    # -- profiling and tracing ----------------------------------------------------------------
    def _start_profiler(self, first: int) -> None:
        """Hand the steps of ``--profile FIRST:LAST`` to torch.profiler (every rank)."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.comm.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()
        self._profiled_from = first

    def stop_profiler(self, st: RunState) -> None:
        """Close the ``--profile`` window, if open, and write ``profile/rank<N>.json``."""
        if self._profiler is None:
            return
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        path = self.out / "profile" / f"rank{self.comm.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if self.is_main:
            self.progress.line(f"profiled steps {self._profiled_from}-{st.step} into "
                               f"{path.parent}/rank*.json")

    def _write_trace(self, st: RunState, lanes: list[Any] | None) -> None:
        """Gather every rank's spans to rank 0 (unless the ``lanes`` are given) and write
        ``trace.json`` (one lane per rank)."""
        if lanes is None:
            lanes = self.comm.gather_objects(self.tl.chrome_events(self.comm.rank))
        if self.is_main:
            assert lanes is not None
            write_trace(self.out / "trace.json", chrome_trace(lanes, {
                "model": self.cfg.model, "strategy": self.cfg.strategy,
                "workers": self.comm.world_size, "steps": st.step}))
