"""Where a run is, and the loop's state a checkpoint carries: :class:`RunState`."""

from __future__ import annotations

import time
from typing import Any

import torch

from shoal.core.comm import Comm
from shoal.core.timeline import step_times


class RunState:
    """Where training is (epoch, step, samples, clocks, the last step's learning rate) and
    this rank's random number generators, time split and bytes sent.

    Checkpoints itself: :meth:`state_dict` gives the progress (the same on every rank; rank
    0's is saved) and this rank's own part; :meth:`load_state_dict` puts both back.
    """

    def __init__(self, comm: Comm, aug_gen: torch.Generator, lr: float) -> None:
        self.comm = comm
        self.epoch = 0  # epochs completed
        self.epoch_step = 0  # steps completed in the current epoch
        self.step = 0  # steps completed in all
        self.samples = 0  # training samples processed, all ranks
        self.train_time_s = 0.0  # rank 0's time inside training steps
        self.wall_time_s = 0.0  # earlier invocations' wall time
        self.lr = lr  # the rate the last step used (the next record reports it)
        self.aug_gen = aug_gen  # this rank's augmentation randomness
        self.started = time.perf_counter()  # this invocation's start; see :meth:`start`

    def start(self) -> None:
        """Start this invocation's wall clock (at the top of the loop)."""
        self.started = time.perf_counter()

    def elapsed_s(self) -> float:
        """Wall time of the whole run so far, earlier invocations included."""
        return self.wall_time_s + time.perf_counter() - self.started

    def step_done(self, samples: int, seconds: float) -> None:
        """Count a finished step of ``samples`` (all ranks) that took ``seconds``."""
        self.train_time_s += seconds
        self.step += 1
        self.epoch_step += 1
        self.samples += samples

    def reported(self, step: int, epoch_step: int, samples: int, lr: float) -> None:
        """A coordinator's run, which trains nothing itself, moved to where its workers'
        reports put it: ``step`` (``epoch_step`` of its epoch), ``samples`` more trained, the
        last step's rate ``lr``; its training time is its wall time so far."""
        self.step, self.epoch_step, self.lr = step, epoch_step, lr
        self.samples += samples
        self.train_time_s = self.elapsed_s()

    def epoch_done(self) -> None:
        self.epoch += 1
        self.epoch_step = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"progress": ..., "rank": ...}``: where the run is, and this rank's own state."""
        progress = {"epoch": self.epoch, "epoch_step": self.epoch_step, "step": self.step,
                    "samples": self.samples, "train_time_s": self.train_time_s,
                    "wall_time_s": self.elapsed_s(), "lr": self.lr}
        own: dict[str, Any] = {
            "rng": torch.get_rng_state(),
            "aug_rng": self.aug_gen.get_state(),
            "times": step_times(self.comm.timeline.totals),
            "bytes_sent": self.comm.bytes_sent,
        }
        if self.comm.device.type == "cuda":
            own["cuda_rng"] = torch.cuda.get_rng_state()
        return {"progress": progress, "rank": own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back a :meth:`state_dict`; its ``"rank"`` is ``None`` on a rank the checkpoint
        has no state of (a run of in-sync replicas resumed on more workers)."""
        p = state["progress"]
        self.epoch, self.epoch_step, self.step = p["epoch"], p["epoch_step"], p["step"]
        self.samples, self.train_time_s = p["samples"], p["train_time_s"]
        self.wall_time_s = p["wall_time_s"]
        # The rate of the step before the checkpoint: the epoch record that may follow at
        # once (a checkpoint at an epoch's last step) reports it.
        self.lr = p.get("lr", self.lr)
        own = state["rank"]
        self.comm.bytes_sent = 0 if own is None else int(own["bytes_sent"])
        if own is None:
            return
        torch.set_rng_state(own["rng"])
        self.aug_gen.set_state(own["aug_rng"])
        if self.comm.device.type == "cuda" and "cuda_rng" in own:
            torch.cuda.set_rng_state(own["cuda_rng"])
        self.comm.timeline.carry_over(own["times"])
