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
  among them, every exchange through their client (:func:`connect`), their evaluation,
  records and checkpoints reported to server 0 (:mod:`shoal.train.remote`). Each stops on
  SIGTERM after its own current step; the checkpoint keeps each one's position.

The launch path (:mod:`shoal.train.launch`) runs each rank's role; this module builds what
the parameter servers are made of: a worker's client (:func:`connect`), a server's shard
and its coordinator (:func:`run_server`).

A worker killed mid-run (``kill -9``) breaks its pairs: the servers mark it lost and the run
completes with the others; ``summary.json`` says ``"degraded": true`` and ``shoal train``
exits with status 3 (``shoal.cli.EXIT_DEGRADED``); with ``--elastic`` its unfinished work is
dealt to the others instead (:mod:`shoal.train.membership.tracker.detached`), and the run is complete. A
worker that fails with an error tells
server 0 before it exits, and the job ends with that error. A server that dies (any of them)
ends the job: its workers' next exchange fails, and shoal's launcher names the server
(``server 1 (rank 1): process killed by signal 9``).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.failures import first_line
from shoal.core.flat import FlatParams
from shoal.core.ops import split_ranges
from shoal.errors import ShoalError
from shoal.ps import ServerClient, connect_worker, keepalive, serve_shard
from shoal.strategies import get_strategy, make_options
from shoal.strategies.asynchronous import AsyncStrategy
from shoal.strategies.easgd import parameter_order
from shoal.strategies.hogwild import (
    COUNT_SLOTS,
    COUNTS_KEY,
    PATH_KEY,
    create_shared_file,
    map_counts,
    map_shared_file,
)
from shoal.strategies.topology import Topology
from shoal.train.checkpoint import load_checkpoint, load_eval_model
from shoal.train.coordinator import Coordinator
from shoal.train.membership.messages import Failed, encode
from shoal.train.membership.server.followers import COORDINATOR, Follower, Leader
from shoal.train.optim import build_optimizer
from shoal.train.workload import Workload

#: Seconds a failing worker waits for server 0 to take its failure report.
FAILURE_REPORT_TIMEOUT = 5.0
#: Seconds server 0 waits for the launcher to say how a lost worker's process ended.
ENDED_TIMEOUT = 5.0


def silence(cfg: TrainConfig) -> float:
    """Seconds a server waits for a silent worker before it is lost: ``--timeout``, or with
    ``--elastic`` ``--heartbeat-timeout`` if shorter (idle workers ping more often)."""
    return min(cfg.timeout, cfg.heartbeat_timeout) if cfg.elastic else cfg.timeout


def intra_host(cfg: TrainConfig) -> str:
    """``--intra-host``: how a server and a worker of one host talk (shared memory unless
    ``gloo``)."""
    return str(cfg.strategy_options.get("intra_host", "auto"))


def shard_ranges(n: int, servers: int) -> list[tuple[int, int]]:
    """The contiguous ``[lo, hi)`` range of the flat vector each server holds."""
    return split_ranges(n, servers)


# -- a worker -----------------------------------------------------------------------------------
def connect(cfg: TrainConfig, comm: Comm, topology: Topology, model: torch.nn.Module
            ) -> ServerClient:
    """A worker's end of the parameter servers, made ``comm.ps`` (before its strategy is
    built: the strategy starts from the servers' vector)."""
    numel = sum(p.numel() for p in model.parameters())
    return connect_worker(comm.store, comm.rank, shard_ranges(numel, topology.servers),
                          cfg.timeout, comm, silence(cfg), intra_host(cfg))


def leave(client: ServerClient, failure: BaseException | None = None) -> None:
    """A worker leaves the servers: done (BYE: not lost), or failed with ``failure``, which
    the coordinator hears first, so that it neither takes this worker for a lost one nor
    reports a failure of its own."""
    if failure is None:
        client.close()
        return
    with contextlib.suppress(ShoalError):
        client.report(encode(Failed(client.client, first_line(failure))),
                      timeout=FAILURE_REPORT_TIMEOUT)
    client.abandon()


# -- a server -----------------------------------------------------------------------------------
def run_server(cfg: TrainConfig, env: Environment, comm: Comm, topology: Topology,
               work: Workload, extra: dict[str, Any] | None = None, seal: Any = None
               ) -> dict[str, Any] | None:
    """Serve this rank's shard of the center until every worker left or was lost; server 0
    also coordinates (the run's records, checkpoints and summary, which it returns) and,
    with the job's join secret ``seal`` (``--elastic``), admits workers that join."""
    server, workers = topology.role(env.rank).index, topology.workers
    strategy_cls = get_strategy(cfg.strategy)
    options = make_options(strategy_cls, cfg.strategy_options, workers)
    payload = load_checkpoint(cfg.resume_path) if cfg.resume_path is not None else None
    start = load_checkpoint(Path(cfg.init_from)) if cfg.init_from and payload is None else None
    model = work.model
    if start is not None:  # --init-from: the run starts from its evaluation model
        load_eval_model(model, start, cfg.init_from or "")
    optimizer = build_optimizer(cfg, model.parameters(), cfg.base_lr(workers))
    flat = FlatParams(parameter_order(model, optimizer))  # the order the strategies pack
    ranges = shard_ranges(flat.numel, topology.servers)
    rule_cls = strategy_cls.Rule if issubclass(strategy_cls, AsyncStrategy) else None
    coordinator: Coordinator | None = None
    paths: list[str] = []  # shared files this server made: removed however it ends
    try:
        counts = _counts(cfg, topology, comm, env, paths, payload) if server == 0 else None
        center = _center(flat, ranges[server], topology, payload, comm, env, paths)
        if server == 0:
            coordinator = _coordinator(cfg, env, comm, topology, work, flat, ranges, payload,
                                       start, extra, seal, counts)
        # Server 0 reads the others' state (its id outside the workers'); under --elastic
        # they follow its word (shoal.train.membership.server.followers).
        follower = Follower(server, comm.attempt_store, cfg.timeout) \
            if server > 0 and cfg.elastic else None
        side = coordinator or follower
        return serve_shard(
            comm.store, server, workers,
            rule_cls(center, options) if rule_cls is not None else None, center,
            strategy_cls.admission(options, workers), timeout=silence(cfg),
            connect_timeout=cfg.timeout, intra_host=intra_host(cfg),
            state=payload["servers"][server] if payload is not None
            and not topology.shared_memory else None,
            on_report=side.on_report if side is not None else None,
            during=side.run if side is not None else None,
            readers=(COORDINATOR,) if server > 0 else ())
    finally:
        if coordinator is not None and coordinator.client is not None:
            coordinator.client.close()
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _coordinator(cfg: TrainConfig, env: Environment, comm: Comm, topology: Topology,
                 work: Workload, flat: FlatParams, ranges: list[tuple[int, int]],
                 payload: dict[str, Any] | None, start: dict[str, Any] | None,
                 extra: dict[str, Any] | None, seal: Any, counts: torch.Tensor | None
                 ) -> Coordinator:
    """Server 0's coordinator, with its client of the other servers (``None`` with one)."""
    client = ServerClient(comm.store, COORDINATOR, ranges[1:], timeout=cfg.timeout,
                          servers=list(range(1, topology.servers)),
                          keepalive=keepalive(cfg.timeout), intra_host=intra_host(cfg)
                          ) if topology.servers > 1 else None
    wait = ENDED_TIMEOUT if env.error_dir is not None else 0.0  # shoal's launcher says it
    asked: dict[int, float] = {}

    def ended(rank: int) -> str | None:  # waited for once: a silent worker's is not coming
        first = asked.setdefault(rank, time.monotonic())
        return comm.ended(rank, max(0.0, first + wait - time.monotonic()))

    coordinator = Coordinator(cfg, comm, work.data, work.model, flat, client, ranges, payload,
                              start if start is not None and cfg.init_progress else None,
                              extra, ended, seal, topology.groups)
    if counts is not None:  # hogwild: a lost worker's count is in the shared file
        coordinator.counted_of = lambda worker, info: counts[worker].tolist() \
            if worker < COUNT_SLOTS else [0, 0]
    if client is not None and cfg.elastic:  # a push counts once every server applied it
        leader = coordinator.followers = Leader(client, comm.attempt_store, topology.servers,
                                                silence(cfg))
        coordinator.counted_of = lambda worker, info: [
            leader.counted(worker, int(info.get("counted", 0))), int(info.get("step", 0))]
    return coordinator


def _counts(cfg: TrainConfig, topology: Topology, comm: Comm, env: Environment,
            paths: list[str], payload: dict[str, Any] | None = None) -> torch.Tensor | None:
    """``--elastic`` with shared memory (hogwild): the file of each worker's count and step,
    zeros (resumed: each worker's count where it goes on, at the checkpoint's step: a worker
    lost before its first step is named at it, not at 0), which every worker maps and writes
    its own to after each step (set in the store before the parameters' path, which the
    workers wait for)."""
    if not (cfg.elastic and topology.shared_memory):
        return None
    counts = torch.zeros(COUNT_SLOTS, 2, dtype=torch.int64)
    for worker, count in (payload or {}).get("servers", [{}])[0].get("counted", {}).items():
        if 0 <= int(worker) < COUNT_SLOTS:  # --resume: where each worker goes on from
            counts[int(worker)] = torch.tensor([int(count), int(payload["coordinator"]["step"])])
    paths.append(create_shared_file(counts.flatten(), env.error_dir))
    comm.store.set(COUNTS_KEY, paths[-1])
    return map_counts(paths[-1])


def _center(flat: FlatParams, shard: tuple[int, int], topology: Topology,
            payload: dict[str, Any] | None, comm: Comm, env: Environment,
            paths: list[str]) -> torch.Tensor:
    """This server's shard of the center, float32; with shared memory (hogwild) the whole
    vector in one file every worker maps and steps in place (the coordinator maps it too:
    evaluation, checkpoints), in the launcher's job folder when there is one (removed even
    if this process is killed), else in /dev/shm; its path is handed out in the store and
    added to ``paths`` (the caller removes it)."""
    vector = flat.pack().detach().float()
    if not topology.shared_memory:
        return vector[shard[0]:shard[1]].clone()
    vector = vector.clone()
    if payload is not None:
        vector.copy_(payload["servers"][0]["center"])
    paths.append(create_shared_file(vector, env.error_dir))
    comm.store.set(PATH_KEY, paths[-1])
    return map_shared_file(paths[-1], vector.numel(), torch.float32)
