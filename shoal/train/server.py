"""An asynchronous job: its parameter servers, its coordinator and its workers.

A strategy with ``asynchronous = True`` (``async-sgd``, ``async-easgd``, ``hogwild``, ...)
runs as ``k + W`` processes, ``k`` = ``--servers``: rank ``r < k`` is **server r**, rank
``k + i`` is **worker i**. shoal's launcher starts them all on the launching host; under
torchrun the first ``k`` ranks (on the node holding the endpoint) are the servers.

- Server ``s`` holds the ``s``-th contiguous range of the flat parameter vector (the center)
  and serves each worker on a two-rank Gloo pair of its own
  (:func:`shoal.ps.serve_shard`): one dead worker breaks only its own pair.
- Server 0 is also the run's **coordinator** (:class:`~shoal.train.coordinator.Coordinator`):
  workers never talk to each other, so it keeps ``--out`` from their reports (epoch
  records, ``checkpoint.pt``, ``summary.json``).
- Workers run the usual :class:`~shoal.train.trainer.Trainer`, detached: no process group
  among them, every exchange through their client (:func:`shoal.ps.connect_worker`). Each stops
  on SIGTERM after its own current step; the checkpoint keeps each one's position.

A worker killed mid-run (``kill -9``) breaks its pairs: the servers mark it lost and the run
completes with the others; ``summary.json`` says ``"degraded": true`` and ``shoal train``
exits with status 3 (``shoal.cli.EXIT_DEGRADED``). A worker that fails with an error tells
server 0 before it exits, and the job ends with that error. A server that dies (any of them)
ends the job: its workers' next exchange fails, and shoal's launcher names the server
(``server 1 (rank 1): process killed by signal 9``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment, default_threads, pick_device
from shoal.core.failures import first_line
from shoal.core.flat import FlatParams
from shoal.core.group import job_store
from shoal.core.ops import split_ranges
from shoal.core.timeline import Timeline
from shoal.data import Dataset, load_dataset
from shoal.errors import ShoalError
from shoal.models import build_model
from shoal.ps import connect_worker, serve_shard
from shoal.strategies import Strategy, get_strategy, make_options
from shoal.strategies.easgd import parameter_order
from shoal.strategies.hogwild import PATH_KEY, create_shared_file, map_shared_file
from shoal.train.checkpoint import load_checkpoint
from shoal.train.coordinator import Coordinator
from shoal.train.optim import build_optimizer

#: Seconds a failing worker waits for server 0 to take its failure report.
FAILURE_REPORT_TIMEOUT = 5.0


def is_asynchronous(cls: type[Strategy]) -> bool:
    """Whether ``cls`` couples its workers through parameter servers (or shared memory)."""
    return bool(getattr(cls, "asynchronous", False))


def server_count(cfg: TrainConfig) -> int:
    """``--servers`` (1 when not given)."""
    return int(cfg.strategy_options.get("servers", 1) or 1)


def shard_ranges(n: int, servers: int) -> list[tuple[int, int]]:
    """The contiguous ``[lo, hi)`` range of the flat vector each server holds."""
    return split_ranges(n, servers)


def _initial_model(cfg: TrainConfig, data: Dataset, workers: int,
                   start: dict[str, Any] | None = None) -> tuple[torch.nn.Module, FlatParams]:
    """The model every rank starts from (the trainer's seed, or ``start``'s evaluation model:
    ``--init-from``) and its flat layout (the order the strategies pack it in)."""
    from shoal.train.trainer import load_eval_model

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    if start is not None:
        load_eval_model(model, start, cfg.init_from or "")
    optimizer = build_optimizer(cfg, model.parameters(), cfg.base_lr(workers))
    return model, FlatParams(parameter_order(model, optimizer))


def run_async_rank(cfg: TrainConfig, env: Environment, data: Dataset | None = None
                   ) -> dict[str, Any] | None:
    """Run this process's part of an asynchronous job: server or worker, by rank."""
    servers = server_count(cfg)
    workers = env.world_size - servers
    if workers < 1:
        raise ShoalError(f"--servers {servers} leaves no worker among {env.world_size} ranks")
    data = data if data is not None else load_dataset(cfg.dataset, _data_options(cfg))
    if env.rank < servers:
        return _run_server(cfg, env, data, env.rank, servers, workers)
    _run_worker(cfg, env, data, env.rank - servers, servers, workers)
    return None


def _data_options(cfg: TrainConfig) -> Any:
    from shoal.train.trainer import data_options

    return data_options(cfg)


# -- a worker -----------------------------------------------------------------------------------
def _run_worker(cfg: TrainConfig, env: Environment, data: Dataset, worker: int, servers: int,
                workers: int) -> None:
    from shoal.train.trainer import Trainer

    on_first_node = env.rank < env.local_world_size
    local_rank = env.local_rank - servers if on_first_node else env.local_rank
    local_workers = env.local_world_size - servers if on_first_node else env.local_world_size
    torch.set_num_threads(cfg.threads_per_worker or default_threads(max(1, local_workers)))
    store = job_store(env, cfg.timeout)
    mine = dataclasses.replace(env, rank=worker, world_size=workers,
                               local_rank=max(0, local_rank))
    # Workers exchange through host memory, never NCCL: several may share a GPU.
    device = pick_device(cfg.device, max(0, local_rank), max(1, local_workers), share=True)
    comm = Comm(mine, device, Timeline(keep_events=cfg.trace), peers=False)
    model, flat = _initial_model(cfg, data, workers)
    client = connect_worker(store, worker, shard_ranges(flat.numel, servers), cfg.timeout, comm)
    comm.store = store  # hogwild finds the shared file through it
    try:
        Trainer(cfg, comm, data).run()
    except BaseException as exc:
        # The job fails with this error: the coordinator hears it first, so that it neither
        # takes this worker for a lost one nor reports a failure of its own.
        with contextlib.suppress(ShoalError):
            client.report({"kind": "failed", "worker": worker, "error": first_line(exc)},
                          timeout=FAILURE_REPORT_TIMEOUT)
        raise
    client.close()  # BYE: done, not lost


# -- a server -----------------------------------------------------------------------------------
def _run_server(cfg: TrainConfig, env: Environment, data: Dataset, server: int, servers: int,
                workers: int) -> dict[str, Any] | None:
    torch.set_num_threads(1)  # serving is copies and axpys; the workers need the cores
    strategy_cls = get_strategy(cfg.strategy)
    options = make_options(strategy_cls, cfg.strategy_options, workers)
    store = job_store(env, cfg.timeout)
    payload = load_checkpoint(cfg.resume_path) if cfg.resume_path is not None else None
    start = load_checkpoint(Path(cfg.init_from)) if cfg.init_from and payload is None else None
    model, flat = _initial_model(cfg, data, workers, start)
    ranges = shard_ranges(flat.numel, servers)
    lo, hi = ranges[server]
    shared_path = None
    if getattr(strategy_cls, "shared_memory", False):
        # hogwild: one float32 file every worker maps and steps in place; the coordinator
        # maps it too (evaluation, checkpoints). In the launcher's job folder when there is
        # one (removed even if this process is killed), else in /dev/shm.
        vector = flat.pack().detach().float().clone()
        if payload is not None:
            vector.copy_(payload["servers"][0]["center"])
        shared_path = create_shared_file(vector, env.error_dir)
        center = map_shared_file(shared_path, vector.numel(), torch.float32)
        store.set(PATH_KEY, shared_path)
    else:
        center = flat.pack().detach().float()[lo:hi].clone()
    rule_cls = getattr(strategy_cls, "Rule", None)
    rule = rule_cls(center, options) if rule_cls is not None else None
    coordinator: Coordinator | None = None
    if server == 0:
        coordinator = Coordinator(cfg, data, model, flat, store, ranges, workers, payload,
                                  start if start is not None and cfg.init_progress else None)
    try:
        return serve_shard(
            store, server, workers + (1 if server > 0 else 0), rule, center,
            strategy_cls.admission(options, workers), timeout=cfg.timeout,
            state=payload["servers"][server] if payload is not None and shared_path is None
            else None,
            on_report=coordinator.on_report if coordinator is not None else None,
            during=coordinator.run if coordinator is not None else None)
    finally:
        if shared_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(shared_path)
