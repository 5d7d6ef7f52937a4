"""Running a training job: start (or join) the workers and run the :class:`Trainer` in each."""

from __future__ import annotations

import json
from typing import Any

import torch

from shoal.comm import init_comm
from shoal.config import TrainConfig, default_threads
from shoal.data import Dataset
from shoal.errors import ShoalError
from shoal.processes import Environment, detect_environment, spawn
from shoal.timeline import Timeline
from shoal.train.trainer import Trainer, preflight


def run_worker(cfg: TrainConfig, data: Dataset | None = None) -> dict[str, Any] | None:
    """Train as this process's rank of the job its environment describes."""
    env = detect_environment() or Environment()
    threads = cfg.threads_per_worker or default_threads(env.local_world_size)
    comm = init_comm(env, cfg.device, cfg.timeout, threads, Timeline(keep_events=cfg.trace))
    try:
        summary = Trainer(cfg, comm, data).run()
    except BaseException as exc:
        comm.abort(str(exc) or type(exc).__name__)
        raise
    comm.close()
    return summary


def _default_workers(cfg: TrainConfig) -> int:
    if cfg.workers is not None:
        return cfg.workers
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return max(1, torch.cuda.device_count()) if cuda else 1


def train(cfg: TrainConfig) -> dict[str, Any] | None:
    """Run the training job ``cfg`` describes; returns rank 0's summary (``None`` elsewhere).

    Under torchrun, Slurm or mpirun this process is one rank of that job. Otherwise
    ``cfg.workers`` local processes are spawned (none for a single worker).
    """
    cfg.validate()
    env = detect_environment()
    if env is not None:
        if cfg.workers is not None and cfg.workers != env.world_size:
            raise ShoalError(f"--workers {cfg.workers} contradicts the launcher's world size "
                             f"{env.world_size} ({env.launcher}); leave --workers out")
        return run_worker(cfg, preflight(cfg, env.world_size))
    world = _default_workers(cfg)
    data = preflight(cfg, world)
    if world == 1:
        return run_worker(cfg, data)
    spawn(world, run_worker, (cfg,))
    with open(cfg.out + "/summary.json") as f:
        return json.load(f)


__all__ = ["Trainer", "preflight", "run_worker", "train"]
