"""Running a training job: start (or join) the workers and run the :class:`Trainer` in each."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shoal.config import TrainConfig
from shoal.core.comm import init_comm
from shoal.core.env import Environment, default_threads, detect_environment, resolve_device
from shoal.core.failures import exit_status, record_failure
from shoal.core.files import read_json
from shoal.core.limits import check_processes
from shoal.core.processes import Lost, spawn, stop_on_sigterm, stop_requested
from shoal.core.timeline import Timeline
from shoal.data import Dataset, as_dataset
from shoal.data.loader import loader_processes
from shoal.errors import ShoalError, WorkerError
from shoal.strategies import get_strategy, make_options
from shoal.train.checkpoint import checkpoint_step
from shoal.train.elastic import check_elastic
from shoal.train.optim import resolve_momentum
from shoal.train.outdir import OutputLock
from shoal.train.records import write_json
from shoal.train.server import is_asynchronous, run_async_rank, server_count
from shoal.train.trainer import Trainer, preflight


def run_worker(cfg: TrainConfig, data: Dataset | None = None) -> dict[str, Any] | None:
    """Train as this process's rank of the job its environment describes."""
    env = detect_environment() or Environment()
    threads = cfg.threads_per_worker or default_threads(env.local_world_size)
    previous = stop_on_sigterm()
    try:
        comm = init_comm(env, cfg.device, cfg.timeout, threads, Timeline(keep_events=cfg.trace),
                         heartbeat_timeout=cfg.heartbeat_timeout, elastic=cfg.elastic)
        try:
            summary = Trainer(cfg, comm, data).run()
        except BaseException as exc:
            comm.abort(str(exc) or type(exc).__name__)
            raise
        comm.close()
        return summary
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def default_workers(cfg: TrainConfig) -> int:
    """``--workers``, else one per GPU with CUDA, else 1."""
    if cfg.workers is not None:
        return cfg.workers
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return max(1, torch.cuda.device_count()) if cuda else 1


def job_device(cfg: TrainConfig, local_workers: int, workers: int) -> TrainConfig:
    """``cfg`` with ``--device`` made cpu or cuda once for the job, before any worker starts
    (:func:`~shoal.core.env.resolve_device`; too few GPUs for ``--device cuda`` is one line):
    ``local_workers`` of the ``workers`` compute on this host. An asynchronous strategy's
    workers may share GPUs; hogwild's step parameters in host memory, so ``auto`` is the CPU
    for it."""
    cls = get_strategy(cfg.strategy)
    if cfg.device == "auto" and getattr(cls, "shared_memory", False):
        return dataclasses.replace(cfg, device="cpu")
    share = is_asynchronous(cls) and cls.may_share_gpus(
        make_options(cls, cfg.strategy_options, workers), workers)
    return dataclasses.replace(cfg, device=resolve_device(cfg.device, local_workers, share=share))


def resolve_auto_resume(cfg: TrainConfig) -> TrainConfig:
    """``--resume auto``: continue from ``<out>/checkpoint.pt`` when it exists, else start
    over in ``--out`` (a restarted job that failed before its first checkpoint)."""
    if cfg.resume != "auto":
        return cfg
    if cfg.checkpoint_path.is_file():
        return dataclasses.replace(cfg, resume="")
    return dataclasses.replace(cfg, resume=None, overwrite=True)


def _last_logged_step(out: Path) -> int:
    """The last step recorded in ``out/metrics.jsonl`` (0 if none)."""
    last = 0
    with contextlib.suppress(OSError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):  # a torn line
                last = max(last, int(json.loads(line).get("step", 0)))
    return last


def _run_with_restarts(cfg: TrainConfig, world: int, servers: int = 0,
                       data: Dataset | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """Spawn the job (``servers`` parameter servers first, for an asynchronous strategy);
    when a rank fails, start it again from the last checkpoint, up to ``cfg.max_restarts``
    times. Returns what each restart redid (for summary.json) and the ranks' results."""
    attempt_cfg, restarts = cfg, []
    while True:
        started = time.monotonic()
        try:
            if servers:
                results = _spawn_async(attempt_cfg, world, servers, data)
            else:  # --elastic: the job goes on without a worker killed, but worker 0's
                # records go with it (a restart then, with --max-restarts)
                results = spawn(world, run_worker, (attempt_cfg, data),
                                tolerate=(lambda rank: rank > 0) if cfg.elastic else None)
            return restarts, results
        except WorkerError as exc:
            if exc.user_error or len(restarts) >= cfg.max_restarts or stop_requested():
                raise
            out = Path(cfg.out)
            failed_at = _last_logged_step(out)
            step = checkpoint_step(cfg.checkpoint_path)
            if step is not None:
                attempt_cfg = dataclasses.replace(cfg, resume="", overwrite=False)
            elif cfg.resume is None:  # no checkpoint of this run yet: start over
                attempt_cfg = dataclasses.replace(cfg, overwrite=True)
            restarts.append({"error": str(exc), "failed_at_step": failed_at,
                             "resumed_from_step": step or 0,
                             "attempt_time_s": time.monotonic() - started})
            print(f"shoal: {exc}; restarting from "
                  + (f"the checkpoint at step {step}" if step is not None else "the start")
                  + f" (restart {len(restarts)} of {cfg.max_restarts})",
                  file=sys.stderr, flush=True)


def train(cfg: TrainConfig, dataset: Any = None) -> dict[str, Any] | None:
    """Run the training job ``cfg`` describes; returns rank 0's summary (``None`` elsewhere).

    ``dataset``: the data as Python objects instead of ``cfg.dataset``'s name: map-style
    torch Datasets as ``(train, test)``, ``(train, test, input_shape, num_classes)``, a dict
    of those or a :class:`shoal.data.Dataset` (see :mod:`shoal.data.user`); they travel to
    the spawned workers pickled (by cloudpickle). ``cfg.dataset`` becomes its name
    (``<object TrainType>``).

    Under torchrun, Slurm or mpirun this process is one rank of that job. Otherwise
    ``cfg.workers`` local processes are spawned (none for a single worker without
    ``--max-restarts``) and restarted from the last checkpoint when one fails, up to
    ``cfg.max_restarts`` times. The process that runs the job holds ``--out`` for its life
    (:class:`~shoal.train.outdir.OutputLock`). After SIGTERM the job stops at the next
    step all ranks reach, checkpoints, and the summary says ``"stopped_by": "SIGTERM"``.

    An asynchronous strategy runs ``--servers`` parameter servers as the first ranks (shoal
    starts them too; see :mod:`shoal.train.server`); a worker killed mid-run is lost, not
    fatal, and the summary lists it (``"degraded": true``).
    """
    cfg.validate()
    given = None
    if dataset is not None:
        given = as_dataset(dataset)
        cfg = dataclasses.replace(cfg, dataset=given.name)
    env = detect_environment()
    check_elastic(cfg, env.launcher if env is not None else None)
    asynchronous = is_asynchronous(get_strategy(cfg.strategy))
    if env is not None:
        return _train_as_rank(cfg, env, asynchronous, given)
    cfg = resolve_auto_resume(cfg)
    world = default_workers(cfg)
    servers = server_count(cfg) if asynchronous else 0
    check_machine(cfg, world, servers)
    cfg = job_device(resolve_momentum(cfg, world), world, world)
    data = preflight(cfg, world, given)
    check_machine(cfg, world, servers, data)
    with OutputLock(Path(cfg.out)):
        if world == 1 and cfg.max_restarts == 0 and not asynchronous:
            return run_worker(cfg, data)
        restarts, results = _run_with_restarts(cfg, world, servers, given)
        path = Path(cfg.out) / "summary.json"
        summary = read_json(path, "summary of the finished job")
        lost = {r.rank: r for r in results if isinstance(r, Lost)}
        for entry in summary.get("lost_workers", []):
            if entry["rank"] in lost:
                entry["exit_status"] = lost[entry["rank"]].status
        if restarts or lost:
            if restarts:
                summary["restarts"] = restarts
            write_json(path, summary)
        return summary


def _train_as_rank(cfg: TrainConfig, env: Environment, asynchronous: bool,
                   given: Dataset | None) -> dict[str, Any] | None:
    """:func:`train` as this process's rank of a job an outside launcher (torchrun, Slurm,
    mpirun) started."""
    servers = server_count(cfg) if asynchronous else 0
    if cfg.workers is not None and cfg.workers + servers != env.world_size:
        raise ShoalError(f"--workers {cfg.workers}{f' and --servers {servers}' if servers else ''}"
                         f" contradict the launcher's world size {env.world_size} "
                         f"({env.launcher}); leave --workers out")
    cfg = resolve_auto_resume(cfg)
    if asynchronous:  # the first --servers ranks serve, the others train
        if env.world_size <= servers:
            raise ShoalError(f"--servers {servers} needs at least {servers + 1} ranks; "
                             f"the launcher started {env.world_size}")
        here = env.local_world_size - (servers if env.rank < env.local_world_size else 0)
        cfg = job_device(cfg, here, env.world_size - servers)
        cfg = resolve_momentum(cfg, env.world_size - servers)
        data = preflight(cfg, env.world_size - servers, given)
        with OutputLock(Path(cfg.out)) if env.rank == 0 else contextlib.nullcontext():
            return run_async_rank(cfg, env, data)
    cfg = job_device(resolve_momentum(cfg, env.world_size), env.local_world_size,
                     env.world_size)
    data = preflight(cfg, env.world_size, given)
    with OutputLock(Path(cfg.out)) if env.rank == 0 else contextlib.nullcontext():
        return run_worker(cfg, data)


def check_machine(cfg: TrainConfig, world: int, servers: int, data: Dataset | None = None) -> None:
    """A one-line error unless this machine can hold the local job's processes: ``world``
    workers and ``servers`` servers, and with ``data`` (once loaded) their loader processes
    too (:mod:`shoal.core.limits`)."""
    threads = cfg.threads_per_worker or default_threads(world + servers)
    loaders = 0 if data is None else (world + servers) * loader_processes(cfg.loader_workers,
                                                                          data.train, threads)
    what = " ".join([f"--workers {world}", *([f"--servers {servers}"] if servers else []),
                     *([f"--loader-workers {cfg.loader_workers}"] if loaders else [])])
    check_processes(what, world + servers, loaders, threads)


def _spawn_async(cfg: TrainConfig, workers: int, servers: int,
                 data: Dataset | None) -> list[Any]:
    """Spawn an asynchronous job: ``servers`` parameter servers, then ``workers`` workers.
    A worker killed mid-run is lost, not fatal: the others go on. A failure names the
    process by its role (``server 1 (rank 1): process killed by signal 9``): a server's
    death ends the job, and its workers' broken exchanges are only its echo."""
    try:
        return spawn(workers + servers, _async_rank, (cfg, data),
                     tolerate=lambda rank: rank >= servers)
    except WorkerError as exc:
        rank = exc.rank
        role = f"server {rank}" if rank < servers else f"worker {rank - servers}"
        message = exc.message if exc.exit_code is None else f"process {exit_status(exc.exit_code)}"
        raise WorkerError(rank, message, exc.traceback, exc.user_error, exc.exit_code,
                          who=f"{role} (rank {rank})") from None


def _async_rank(cfg: TrainConfig, data: Dataset | None = None) -> dict[str, Any] | None:
    """A spawned rank of an asynchronous job (server or worker, by rank); ``data``: a
    dataset given in Python, else loaded by name."""
    env = detect_environment()
    assert env is not None
    previous = stop_on_sigterm()
    try:
        return run_async_rank(cfg, env, data)
    except Exception as exc:
        if env.error_dir is None:
            raise
        # Reported, then gone at once: tearing down the Gloo pairs of a failed rank can
        # block on a peer that is failing too, which would hold the job's end for seconds.
        record_failure(env.error_dir, env.rank, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


__all__ = ["Trainer", "default_workers", "preflight", "resolve_auto_resume", "run_worker",
           "train"]
