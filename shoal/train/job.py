"""A training job: its ranks started here (restarted from the last checkpoint when one fails)
or this process as one rank of a job an outside launcher started (torchrun, Slurm, mpirun),
the work of each rank run by :func:`shoal.train.launch.run_rank`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from shoal.config import TrainConfig
from shoal.core.env import (
    Environment,
    default_threads,
    detect_environment,
    rank_environment,
    resolve_device,
)
from shoal.core.failures import exit_status
from shoal.core.group import job_store, mesh_not_formed
from shoal.core.guard import skip_exit_collection
from shoal.core.keeper import Child, keep_rank, start_child
from shoal.core.limits import check_processes
from shoal.core.processes import Lost, spawn
from shoal.core.starting import ensure_server, server_modules
from shoal.core.stop import request_leave, stop_requested
from shoal.core.trust import Seal, open_own
from shoal.core.waits import key_prefix
from shoal.data import Dataset, as_dataset
from shoal.data.loader import loader_processes
from shoal.errors import ShoalError, Terminated, WorkerError
from shoal.strategies.topology import Topology
from shoal.train.checkpoint import Saved, saved_checkpoint
from shoal.train.launch import job_topology, outside_topology, run_rank
from shoal.train.membership.jobfile import (
    JOIN_SECRET_VAR,
    join_secret,
    publish,
    publish_in_store,
    withdraw,
    withdraw_from_store,
)
from shoal.train.membership.policy import check_elastic
from shoal.train.optim import resolve_momentum
from shoal.train.outdir import OutputLock
from shoal.train.resize import (
    end_joiners,
    first_joiner_id,
    only_as_many,
    resize_at_resume,
    start_joiners,
)
from shoal.train.workload import preflight

log = logging.getLogger("shoal.train")


def default_workers(cfg: TrainConfig) -> int:
    """``--workers``, else one per GPU with CUDA, else 1."""
    if cfg.workers is not None:
        return cfg.workers
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return max(1, torch.cuda.device_count()) if cuda else 1


def job_device(cfg: TrainConfig, topology: Topology, local_workers: int) -> TrainConfig:
    """``cfg`` with ``--device`` made cpu or cuda once for the job, before any worker starts
    (:func:`~shoal.core.env.resolve_device`; too few GPUs for ``--device cuda`` is one line):
    ``local_workers`` of the job's workers compute on this host. Workers that meet in no
    NCCL group (each its own group, an asynchronous job's) may share GPUs; workers that step
    parameters in host memory (hogwild) take the CPU for ``auto``."""
    if cfg.device == "auto" and topology.shared_memory:
        return dataclasses.replace(cfg, device="cpu")
    return dataclasses.replace(cfg, device=resolve_device(cfg.device, local_workers,
                                                          share=topology.shares_gpus))


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


def _start_again(exc: WorkerError, failed_at: int, restarts: list[dict[str, Any]]) -> bool:
    """Whether ``exc`` is Gloo's mesh failing to form as the job started (:func:`mesh_not_formed`),
    before any step (``failed_at``, the last step recorded, is 0), with no such start retried
    yet: the job then starts once more, not counted against ``--max-restarts``."""
    return (mesh_not_formed(str(exc)) and failed_at == 0
            and not any(r.get("mesh") for r in restarts))


def _run_with_restarts(cfg: TrainConfig, topology: Topology, data: Dataset | None = None,
                       grow_to: int = 0, stay: int = 0, before: int = 0
                       ) -> dict[str, Any] | None:
    """Spawn the job's processes (parameter servers first, where the topology has them);
    when a rank fails, start the job again from the last checkpoint, up to
    ``cfg.max_restarts`` times. Returns rank 0's summary, which says what each restart
    redid. ``grow_to``: the workers to reach by joiners the launcher starts with the job;
    ``stay``: the workers that go on, the others leaving at their first meeting;
    ``before``: the membership changes of the checkpoint resumed (:mod:`shoal.train.resize`)."""
    attempt_cfg, attempt, restarts, joiners = cfg, topology, [], []
    # The job's secret: it seals the job's store, and under --elastic proves its joiners,
    # which only its workers and its user's ``shoal join`` learn (through the job file,
    # shoal.train.membership.jobfile).
    secret = Seal()
    seal = secret if cfg.elastic and data is None else None

    def on_store(port: int, workers: int) -> None:
        publish(cfg, port, seal.key_hex, workers, first_id=first_joiner_id(attempt_cfg))
        joiners.extend(start_joiners(Path(cfg.out), max(0, grow_to - workers)))

    while True:
        started, since, summary = time.monotonic(), time.time(), None
        extra = {"restarts": restarts} if restarts else None
        try:
            results = spawn(attempt.world_size, _spawned_rank,
                            (attempt_cfg, attempt, data, extra, seal and seal.key_hex, stay),
                            tolerate=lambda rank: _tolerated(cfg, topology, rank),
                            on_store=seal and (lambda port, n=attempt.workers: on_store(port, n)),
                            secret=bytes.fromhex(secret.key_hex))
            summary = _summary(cfg, topology, results, since)
            return summary
        except WorkerError as exc:
            exc, failed_at = _by_role(exc, topology), _last_logged_step(Path(cfg.out))
            mesh = _start_again(exc, failed_at, restarts)
            counted = sum(not r.get("mesh") for r in restarts)
            if exc.user_error or stop_requested() or (counted >= cfg.max_restarts and not mesh):
                raise exc from None
            saved = saved_checkpoint(cfg.checkpoint_path)
            step = None if saved is None else saved.step
            if saved is not None:
                attempt_cfg = dataclasses.replace(cfg, resume="", overwrite=False)
            elif cfg.resume is None:  # no checkpoint of this run yet: start over
                attempt_cfg = dataclasses.replace(cfg, overwrite=True)
            restarts.append({"error": str(exc), "failed_at_step": failed_at,
                             "resumed_from_step": step or 0,
                             "attempt_time_s": time.monotonic() - started, "mesh": mesh})
            where = f"the checkpoint at step {step}" if step is not None else "the start"
            how = ("Gloo's connections did not form as the job started: starting it once more "
                   "(not counted as a restart)") if mesh else \
                f"restarting from {where} (restart {counted + 1} of {cfg.max_restarts})"
            log.warning(f"shoal: {exc}; {how}")
            attempt = _restarted(cfg, topology, saved) if saved is not None else topology
        finally:  # the job ended (a summary) or failed (None: those left are stopped)
            end_joiners(joiners, summary, before)
            joiners.clear()


def _restarted(cfg: TrainConfig, topology: Topology, checkpoint: Saved) -> Topology:
    """The job to start again from its ``checkpoint``: the same, but where the workers' states
    drift apart (``local-sgd``, ``easgd``, ``diloco``: each resumes its own), ``--elastic``
    left fewer and the checkpoint is inside an epoch, on the workers it holds. ``sync``'s
    replicas go on on all of them (the rest of the epoch dealt over them,
    :mod:`.resume_sync`), as drifting ones do from an epoch's end; an asynchronous job's on
    its first ``--workers``. ``--compress powersgd`` resumes on as many workers as the
    checkpoint holds, wherever it is (each worker's error feedback is its own)."""
    saved, why = checkpoint.ranks, only_as_many(cfg, checkpoint)
    if topology.servers or saved == topology.workers or why is None:
        return topology
    log.info(f"shoal: the checkpoint holds {saved} workers' state{why}: {saved} start again")
    return job_topology(cfg, saved)


def _summary(cfg: TrainConfig, topology: Topology, results: list[Any], since: float
             ) -> dict[str, Any] | None:
    """Rank 0's summary; an elastic job that lost worker 0: the lowest id left's. Every
    worker started here lost: the joiners' summary when the job went on in them and wrote
    one (after ``since``, a UNIX time), else a failure, which ``--max-restarts`` restarts."""
    summary = next((r for r in results if isinstance(r, dict)), None)
    workers = results[topology.servers:]
    if summary is None and cfg.elastic and workers and all(isinstance(r, Lost) for r in workers):
        summary = _joiners_summary(Path(cfg.out) / "summary.json", since)
        if summary is not None:
            log.info(f"shoal: every worker started here was lost; the job went on in the workers "
                     f"that joined it and ended (results in {cfg.out})")
            return summary
        if stop_requested():  # SIGTERM while the job went on in its joiners
            raise Terminated("stopped by SIGTERM once every worker started here was lost "
                             "(the workers that joined stop with the job's store)")
        how = "; ".join(f"worker {r.rank - topology.servers} {r.status}" for r in workers)
        raise WorkerError(workers[0].rank, f"every worker was lost ({how}); the job ends with "
                          "them", exit_code=workers[0].exitcode, who="the job")
    return summary


def _joiners_summary(path: Path, since: float) -> dict[str, Any] | None:
    """The summary at ``path`` that the job's joiners wrote (after ``since``, a UNIX time;
    a file of this user's, not a link), if there is one."""
    with contextlib.suppress(OSError, ShoalError, ValueError), os.fdopen(open_own(path), "rb") as f:
        if os.fstat(f.fileno()).st_mtime >= since:
            summary = json.loads(f.read())
            return summary if isinstance(summary, dict) else None
    return None


def _spawned_rank(cfg: TrainConfig, topology: Topology, data: Dataset | None,
                  extra: dict[str, Any] | None, key: str | None, stay: int = 0
                  ) -> dict[str, Any] | None:
    """A rank shoal's launcher started; ``data``: a dataset given in Python; ``key``: an
    elastic job's join secret (hex); ``stay``: the workers that go on (the others leave at
    their first meeting), 0: all."""
    skip_exit_collection()
    env = detect_environment()
    assert env is not None
    if stay and env.rank >= topology.servers + stay:
        request_leave()
    return run_rank(cfg, env, topology, data=data, extra=extra,
                    seal=Seal(bytes.fromhex(key)) if key else None)


def _by_role(exc: WorkerError, topology: Topology) -> WorkerError:
    """A failure of a job with servers names the process by its role (``server 1 (rank 1):
    process killed by signal 9``): a server's death ends the job, and its workers' broken
    exchanges are only its echo."""
    if not topology.servers:
        return exc
    message = exc.message if exc.exit_code is None else f"process {exit_status(exc.exit_code)}"
    return WorkerError(exc.rank, message, exc.traceback, exc.user_error, exc.exit_code,
                       who=f"{topology.role(exc.rank)} (rank {exc.rank})")


def train(cfg: TrainConfig, dataset: Any = None) -> dict[str, Any] | None:
    """Run the training job ``cfg`` describes; returns rank 0's summary (``None`` elsewhere).

    ``dataset``: the data as Python objects instead of ``cfg.dataset``'s name: map-style
    torch Datasets as ``(train, test)``, ``(train, test, input_shape, num_classes)``, a dict
    of those or a :class:`shoal.data.Dataset` (see :mod:`shoal.data.user`); they travel to
    the spawned workers pickled (by cloudpickle). ``cfg.dataset`` becomes its name
    (``<object TrainType>``).

    Under torchrun, Slurm or mpirun this process is one rank of that job. Otherwise the
    job's processes are spawned (none for a single worker without ``--max-restarts``) and
    started again from the last checkpoint when one fails, up to ``cfg.max_restarts``
    times. The process that runs the job holds ``--out`` for its life
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
    env = rank_environment()
    check_elastic(cfg)
    if env is not None:
        return _keep_rank(cfg, env, given) if cfg.elastic else _train_as_rank(cfg, env, given)
    cfg = resolve_auto_resume(cfg)
    cfg, joiners, stay, resized, before = resize_at_resume(cfg, given is not None)
    topology = job_topology(cfg, default_workers(cfg))
    check_machine(cfg, topology)
    # In processes of their own: several ranks, restarts, or a membership (its store)
    spawned = topology.world_size > 1 or cfg.max_restarts > 0 or cfg.elastic
    if spawned:
        # It imports torch for the workers while the checks below run (and torch's compiler
        # front end for --compile; shoal.core.dynamo keeps it out otherwise).
        ensure_server(server_modules(compile=cfg.compile, trains=True))
    cfg = job_device(resolve_momentum(cfg, topology.workers), topology, topology.workers)
    work = preflight(cfg, topology.workers, given)
    check_machine(cfg, topology, work.data)
    if resized:  # said once the run's checks passed
        log.info(resized)
    with OutputLock(Path(cfg.out)):
        if not spawned:  # here, in this process
            return run_rank(cfg, Environment(), topology, work)
        try:
            return _run_with_restarts(cfg, topology, given,
                                      topology.workers + joiners if joiners else 0, stay,
                                      before)
        finally:
            if cfg.elastic:
                withdraw(Path(cfg.out))


def _tolerated(cfg: TrainConfig, topology: Topology, rank: int) -> bool:
    """Whether the job goes on when ``rank`` is killed: an asynchronous job's workers;
    with ``--elastic`` every worker (worker 0's records are then written by the lowest id
    left), but not a server."""
    return rank >= topology.servers and (topology.detached or cfg.elastic)


def _train_as_rank(cfg: TrainConfig, env: Environment, given: Dataset | None
                   ) -> dict[str, Any] | None:
    """:func:`train` as this process's rank of a job an outside launcher (torchrun, Slurm,
    mpirun) started."""
    topology = outside_topology(cfg, env)
    cfg = _rank_config(cfg, env, topology)
    work = preflight(cfg, topology.workers, given)
    key = join_secret() if cfg.elastic else None  # torchrun: its user's, for joiners
    seal = Seal(bytes.fromhex(key)) if key is not None else None
    with OutputLock(Path(cfg.out)) if env.rank == 0 else contextlib.nullcontext():
        return run_rank(cfg, env, topology, work, seal=seal)


def _rank_config(cfg: TrainConfig, env: Environment, topology: Topology) -> TrainConfig:
    """``cfg`` as a rank of an outside launcher's job runs it: ``--resume auto`` resolved,
    the momentum rule's numbers and the job's device."""
    cfg = resolve_auto_resume(cfg)
    return job_device(resolve_momentum(cfg, topology.workers), topology,
                      topology.local_workers(env))


def _keep_rank(cfg: TrainConfig, env: Environment, given: Dataset | None
               ) -> dict[str, Any] | None:
    """``--elastic`` under torchrun, mpirun or Slurm: this process keeps its rank's work in a
    child of its own, so that a worker lost is not a failure the launcher sees
    (:mod:`shoal.core.keeper`). The child is forked first, before this process reaches the
    job's store (or serves it) or runs a thread: it starts with torch imported and none of
    this process's connections. With a join secret (:data:`~shoal.train.membership.jobfile.JOIN_SECRET_VAR`)
    rank 0's keeper publishes the job file ``shoal join`` reads, until the job ends. Where no
    launcher serves the job's store (mpirun, Slurm), rank 0's keeper serves it and its child is a
    client like the others."""
    topology = outside_topology(cfg, env)
    child_env = dataclasses.replace(env, agent_store=True)
    child = start_child(_train_as_rank, (cfg, child_env, given), f"shoal-rank-{env.rank}",
                        fork=True)
    try:
        return _keep_with_store(cfg, env, topology, child)
    finally:
        child.end()  # ended by now but where this keeper failed before it kept it


def _keep_with_store(cfg: TrainConfig, env: Environment, topology: Topology, child: Child
                     ) -> dict[str, Any] | None:
    """:func:`_keep_rank` once its ``child`` started: the job's store, the job file, and
    the keeping."""
    import torch.distributed as dist

    store = job_store(env, cfg.timeout)
    keys = dist.PrefixStore(key_prefix(env.attempt), store)
    secret = join_secret() if env.rank == 0 else None
    if secret is not None:
        rank_cfg = _rank_config(cfg, env, topology)
        first_id = first_joiner_id(rank_cfg)
        publish(rank_cfg, env.master_port, None, topology.workers, address=env.master_addr,
                attempt=env.attempt, first_id=first_id)
        publish_in_store(store, rank_cfg, env.master_addr, env.master_port, secret,
                         topology.workers, env.attempt, first_id)
        log.info(f"shoal: the job takes joiners: shoal join {cfg.out} (or, from a host that does "
                 f"not see it, shoal join --store {env.master_addr}:{env.master_port}), with "
                 f"{JOIN_SECRET_VAR}")
    try:
        return keep_rank(env.rank, keys, child, range(topology.servers, topology.world_size),
                         _tolerated(cfg, topology, env.rank),
                         serving=env.rank == 0 and not env.agent_store)
    finally:
        if secret is not None:
            withdraw(Path(cfg.out))
            withdraw_from_store(store)


def check_machine(cfg: TrainConfig, topology: Topology, data: Dataset | None = None) -> None:
    """A one-line error unless this machine can hold the local job's processes: its workers
    and servers, and with ``data`` (once loaded) their loader processes too
    (:mod:`shoal.core.limits`)."""
    world = topology.world_size
    threads = cfg.threads_per_worker or default_threads(world)
    loaders = 0 if data is None else world * loader_processes(cfg.loader_workers, data.train,
                                                              threads)
    what = " ".join([f"--workers {topology.workers}",
                     *([f"--servers {topology.servers}"] if topology.servers else []),
                     *([f"--loader-workers {cfg.loader_workers}"] if loaders else [])])
    check_processes(what, world, loaders, threads)
