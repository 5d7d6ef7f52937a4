"""What each process of a job loads once, and what is checked before any worker starts.

:func:`load_workload` loads the data set and builds the model at its initial weights, once
per process: a rank trains (or serves, or coordinates) with what it loaded. :func:`preflight`
checks a run's settings against them in the process that starts the job (or in every rank
of an outside launcher's job), so that most mistakes are one line and no processes.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.files import check_output_dir
from shoal.data import DataOptions, Dataset, EpochPlan, load_dataset
from shoal.errors import ShoalError
from shoal.models import build_model
from shoal.strategies import get_strategy, make_options
from shoal.train.checkpoint import (
    check_init,
    check_resume,
    load_checkpoint,
    load_eval_model,
    resumes_in_place,
)
from shoal.train.optim import build_optimizer, resolve_momentum
from shoal.train.records import require_tensorboard


def data_options(cfg: TrainConfig) -> DataOptions:
    return DataOptions(cfg.data_dir, cfg.seed, tuple(cfg.synthetic_shape), cfg.synthetic_classes,
                       cfg.synthetic_samples, cfg.image_size, cfg.synthetic_noise)


@dataclasses.dataclass
class Workload:
    """A process's data set and its model at the run's initial weights (``--seed``: the same
    on every rank), on the CPU."""

    data: Dataset
    model: nn.Module


def load_workload(cfg: TrainConfig, data: Dataset | None = None) -> Workload:
    """Load ``cfg``'s data (``data`` when given: a dataset handed over in Python) and build
    its model, seeded: identical initial weights on every rank."""
    data = data if data is not None else load_dataset(cfg.dataset, data_options(cfg))
    torch.manual_seed(cfg.seed)
    return Workload(data, build_model(cfg.model, data.input_shape, data.num_classes))


def preflight(cfg: TrainConfig, world: int, data: Dataset | None = None) -> Workload:
    """Everything that can be checked before workers start: data, model fit, strategy
    options, output directory and resume file. Returns the loaded workload (its model
    untouched: the checks work on a copy)."""
    cfg = resolve_momentum(cfg, world)  # a no-op where the launcher resolved it
    strategy_cls = get_strategy(cfg.strategy)
    options = make_options(strategy_cls, cfg.strategy_options, world)
    if cfg.tensorboard:
        require_tensorboard()
    work = load_workload(cfg, data)
    probe = copy.deepcopy(work.model)
    if cfg.init_from is not None and cfg.resume_path is None:
        start = load_checkpoint(Path(cfg.init_from))
        check_init(start, cfg, world)
        load_eval_model(probe, start, cfg.init_from)
    # A strategy alone (rank 0 of the job's size, no other rank to talk to) checks how it
    # fits the model and optimizer.
    strategy_cls(probe, build_optimizer(cfg, probe.parameters(), cfg.base_lr(world)),
                 Comm(Environment(world_size=world, local_world_size=world), torch.device("cpu"),
                      peers=False), options)
    EpochPlan(len(work.data.train), cfg.global_batch(world), world, cfg.seed)
    check_features(cfg, work.data)
    _check_out(cfg, world, strategy_cls)
    return work


def _check_out(cfg: TrainConfig, world: int, strategy_cls: type) -> None:
    """``--out`` takes this run: a new run, one it resumes (its checkpoint fits), or one
    ``--overwrite`` replaces."""
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
