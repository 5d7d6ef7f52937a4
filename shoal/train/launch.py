"""One rank of a training job, whatever started it: :func:`run_rank`.

shoal's own launcher, torchrun, Slurm's srun, mpirun, or a process alone: every rank runs
the same function. It stops at the next safe point on SIGTERM (Slurm's preemption notice),
tells the others when it fails, builds its :class:`~shoal.core.comm.Comm` as the strategy's
:class:`~shoal.strategies.topology.Topology` says (the job's process group, or none: the
servers' store and a compute group's process group, joined before the strategy is built),
builds the model and loads the data once, then plays its role: worker (a
:class:`~shoal.train.trainer.Trainer`) or parameter server (:mod:`shoal.train.server`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.connect import init_comm
from shoal.core.env import Environment, default_threads
from shoal.core.failures import record_failure
from shoal.core.group import join_group
from shoal.core.guard import name_process
from shoal.core.stop import Leaving, stop_on_sigterm
from shoal.core.timeline import Timeline
from shoal.core.trust import Seal
from shoal.core.waits import ended_key, say_finished
from shoal.data import Dataset
from shoal.errors import ShoalError
from shoal.strategies import get_strategy, make_options
from shoal.strategies.topology import Topology
from shoal.train.membership.tracker.compute_group import group_membership
from shoal.train.optim import resolve_momentum
from shoal.train.remote import remote_components
from shoal.train.server import connect, leave, run_server
from shoal.train.trainer import Trainer
from shoal.train.workload import Workload, load_workload


def job_topology(cfg: TrainConfig, workers: int) -> Topology:
    """How ``cfg``'s strategy lays out a job of ``workers`` workers."""
    cls = get_strategy(cfg.strategy)
    return cls.topology(make_options(cls, cfg.strategy_options), workers)


def outside_topology(cfg: TrainConfig, env: Environment) -> Topology:
    """The layout of a job an outside launcher started with ``env.world_size`` processes:
    the strategy's servers first, the rest workers; a one-line error unless they fit
    (``--workers`` when given, at least one worker)."""
    cls = get_strategy(cfg.strategy)
    options = make_options(cls, cfg.strategy_options)
    servers = cls.servers(options)
    also = f" and --servers {servers}" if servers else ""
    if cfg.workers is not None and cfg.workers + servers != env.world_size:
        raise ShoalError(f"--workers {cfg.workers}{also} contradict the launcher's world size "
                         f"{env.world_size} ({env.launcher}); leave --workers out")
    if env.world_size <= servers:
        raise ShoalError(f"--servers {servers} needs at least {servers + 1} ranks; "
                         f"the launcher started {env.world_size}")
    return cls.topology(options, env.world_size - servers)


def run_rank(cfg: TrainConfig, env: Environment, topology: Topology, work: Workload | None = None,
             data: Dataset | None = None, extra: dict[str, Any] | None = None,
             seal: Seal | None = None) -> dict[str, Any] | None:
    """Run rank ``env.rank`` of the job ``topology`` lays out; rank 0 returns the summary.

    ``work``: this process's workload, when it is loaded already (else loaded here, from
    ``data`` when given: a dataset handed over in Python); ``extra``: what the summary adds
    (the launcher's restarts); ``seal``: an elastic job's join secret (joiners prove they
    know it, :mod:`shoal.core.admission`). A failure is told to the others (the job's abort key; a
    detached worker's coordinator) before it is raised; under shoal's launcher the rank then
    reports it and exits at once (tearing down the Gloo pairs of a failed rank can block on
    a peer that is failing too, which would hold the job's end for seconds).
    """
    name_process(f"shoal {topology.role(env.rank)}")  # shoal worker 2, shoal server 0
    previous = stop_on_sigterm()
    try:
        comm = join(cfg, env, topology)
        if comm.membership is not None:
            comm.membership.seal = seal
        try:
            result = _play(cfg, env, comm, topology, work, data, extra, seal)
        except Leaving as left:  # asked to, or its compute group broke: the others go on
            _left(comm, env.rank, left.why)
            return None
        except Exception as exc:
            if env.error_dir is not None:
                _exit_failed(env, exc)
            raise
        if cfg.elastic:
            say_finished(comm.attempt_store, result)
        comm.close()
        return result
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def join(cfg: TrainConfig, env: Environment, topology: Topology,
         store: dist.Store | None = None) -> Comm:
    """This rank's Comm: the job's process group; or, in a job whose workers meet only
    through their servers, the job's store (``store`` when given) and the process group of
    this worker's compute group (before the strategy is built). A server computes little:
    one thread."""
    timeline = Timeline(keep_events=cfg.trace)
    if not topology.detached:
        threads = cfg.threads_per_worker or default_threads(env.local_world_size)
        return init_comm(env, cfg.device, cfg.timeout, threads, timeline,
                         heartbeat_timeout=cfg.heartbeat_timeout, elastic=cfg.elastic)
    place = topology.place(env)
    if topology.role(env.rank).is_server:
        return init_comm(env, "cpu", cfg.timeout, 1, timeline, place=place, store=store)
    threads = cfg.threads_per_worker or default_threads(place.local_world_size)
    comm = init_comm(env, cfg.device, cfg.timeout, threads, timeline, place=place, store=store)
    first, end = topology.group(place.rank)
    if end - first > 1:
        group = comm.join_subgroup(f"groups/{first}", place.rank - first, end - first,
                                   cfg.timeout)
        if cfg.elastic:  # re-formed from its members alive when one is lost
            group_membership(comm, group, (first, end), place.rank, cfg, env.attempt)
    return comm


def _play(cfg: TrainConfig, env: Environment, comm: Comm, topology: Topology,
          work: Workload | None, data: Dataset | None = None, extra: dict[str, Any] | None = None,
          seal: Seal | None = None) -> dict[str, Any] | None:
    """Load this process's workload (unless ``work`` is) and play its role in ``topology``:
    parameter server or worker; rank 0's summary. A failure is told to the others (the job's
    abort key; a detached worker's coordinator) before it is raised."""
    try:
        work = work or load_workload(cfg, data)
        if topology.role(env.rank).is_server:
            return run_server(cfg, env, comm, topology, work, extra, seal)
        return _train(cfg, comm, topology, work, extra)
    except Leaving:  # at a meeting, its work counted: nothing to tell the others but that
        raise
    except BaseException as exc:
        comm.abort(str(exc) or type(exc).__name__)
        if comm.ps is not None:
            leave(comm.ps, exc)
        raise


def _train(cfg: TrainConfig, comm: Comm, topology: Topology, work: Workload,
           extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """A worker's run; a detached one's through its servers, reporting to server 0."""
    if not topology.detached:
        return Trainer(cfg, comm, work.data, work.model, extra=extra).run()
    client = connect(cfg, comm, topology, work.model)
    try:
        Trainer(cfg, comm, work.data, work.model, components=remote_components(client)).run()
    except Leaving as left:  # its work sent: it leaves as a lost worker does
        # its reason in the store before its pairs break: server 0 reads it at the loss
        # (at once where no launcher of shoal's says how a rank ended: torchrun's)
        _say_left(comm, topology.servers + comm.rank, left.why)
        client.abandon()
        raise
    leave(client)
    return None


def _say_left(comm: Comm, rank: int, why: str) -> None:
    """Say in the store why rank ``rank`` left (what the others record of its end)."""
    with contextlib.suppress(Exception):  # the store gone: so is the job
        comm.attempt_store.set(ended_key(rank), why)


def _left(comm: Comm, rank: int, why: str) -> None:
    """This rank's worker left the job (asked to by a ``--resume`` on fewer workers than the
    checkpoint holds, or its compute group lost its leader in its exchange): the others
    read ``why`` in the store and go on."""
    _say_left(comm, rank, why)
    comm.aborted = True  # nobody waits for it at the end
    comm.close("left")


def relaid(cfg: TrainConfig, env: Environment, comm: Comm, data: Dataset, tag: str
           ) -> dict[str, Any] | None:
    """Run ``cfg``, whose workers meet through parameter servers, on the ranks of a job that
    has its process group (``comm``): every rank leaves the job's group, plays its role in
    ``cfg``'s layout of the same ranks (servers first) on a namespace ``tag`` of the job's
    store, then joins the job's group again, whatever the run did. What ``shoal train
    --strategy auto`` under torchrun, Slurm or mpirun does for a trial of ``groups`` or an
    asynchronous strategy, and for such a winner. Every rank must call it with the same
    ``tag``, new for each call; rank 0 (server 0) returns the run's summary."""
    topology = outside_topology(cfg, env)
    cfg = resolve_momentum(cfg, topology.workers)
    work = load_workload(cfg, data)
    store, threads = dist.PrefixStore(f"relaid/{tag}", comm.store), torch.get_num_threads()
    dist.destroy_process_group()
    try:
        inner = join(cfg, env, topology, store)
        try:
            return _play(cfg, env, inner, topology, work)
        finally:
            inner.close()
    finally:
        torch.set_num_threads(threads)
        join_group(dist.PrefixStore(f"relaid/{tag}/job", comm.store), env.rank, env.world_size,
                   comm.device.type, cfg.timeout, where="the job's process group again")


def _exit_failed(env: Environment, exc: Exception) -> None:
    """Report ``exc`` to shoal's launcher and leave at once."""
    assert env.error_dir is not None
    record_failure(env.error_dir, env.rank, exc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


__all__ = ["job_topology", "join", "outside_topology", "run_rank"]
