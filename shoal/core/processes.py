"""Starting and supervising local processes.

:func:`spawn` starts and supervises local workers so that one failing worker brings the
whole job down within seconds and its error is reported as one line. :func:`spawn` and
``shoal.fork`` start their processes with :func:`start_process`, which never re-runs the
caller's main program.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from typing import Any

import cloudpickle

from shoal.core.env import Environment, set_environment
from shoal.core.failures import exit_status, first_line, record_failure, root_cause
from shoal.core.guard import guarded_name, name_process
from shoal.core.limits import check_processes
from shoal.core.outlive import STALE, outlive
from shoal.core.starting import new_process, server_lost, start_guarded
from shoal.core.stop import STOP, Flag
from shoal.core.waits import ended_key, key_prefix, members_now, say_gone
from shoal.errors import JobError, ShoalError, Terminated, WorkerError

log = logging.getLogger("shoal.processes")


def loopback_store(timeout: float, secret: bytes | None = None) -> Any:
    """A TCPStore served by this process that listens on loopback only, sealed with
    ``secret`` (a fresh one when ``None``; :mod:`shoal.core.sealed`), behind a gate that
    closes the connections of the other users of this machine (Linux;
    :mod:`shoal.core.gate`), which ends when the returned store is dropped.

    ``torch.distributed.TCPStore`` binds its server to every interface whatever host name it
    is given, so a job on one machine would take commands (``shoal/abort``) from anyone who
    can reach it. Here the listening socket is bound to loopback first and handed over
    (``master_listen_fd``); the store owns and closes it. Without a gate, the seal keeps the
    other users of this machine, who reach loopback, from reading or addressing any key.
    """
    import secrets
    import weakref
    from datetime import timedelta

    import torch.distributed as dist

    from shoal.core.gate import store_listener
    from shoal.core.sealed import SealedStore

    fd, gate = store_listener()
    try:
        inner = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        if gate is not None:
            gate.close()
        raise
    store = SealedStore(inner, secret or secrets.token_bytes(32))
    if gate is not None:
        weakref.finalize(store, gate.close)
    return store


def loopback_gloo_interface() -> str | None:
    """``lo`` where this machine has it: the interface that keeps a one-machine job's Gloo
    connections on loopback (Gloo otherwise listens on the address the host name resolves
    to, often the machine's network address). Gloo reads it from ``GLOO_SOCKET_IFNAME``."""
    if sys.platform.startswith("linux") and "lo" in {name for _, name in socket.if_nameindex()}:
        return "lo"
    return None


def start_process(target: Callable[..., Any], args: tuple[Any, ...] = (), *,
                  name: str | None = None) -> BaseProcess:
    """Start ``target(*args)`` in a new process that does not re-run ``__main__`` and never
    outlives this process: forked from a server that imported torch once, or a fresh
    interpreter (:mod:`shoal.core.starting`), in this process's environment either way.

    Python's "spawn" makes every child import the parent's main module again: that fails when
    it is no file (``python -``, ``-c``, a REPL, a notebook), and re-runs an unguarded script's
    top level. Here the child runs :mod:`shoal.core.guard` in its place instead, first thing,
    before it imports anything of shoal or torch: it dies with this process from then on, and
    at once if this process is already gone (see that module). ``target`` and ``args`` are
    pickled by multiprocessing (so a Connection may be among them), which names functions by
    import path: functions of ``__main__`` must travel by value instead, as :func:`spawn`
    sends them (cloudpickled bytes). The process is not daemonic, so it may start processes
    itself.
    """
    process = new_process(target, args, daemon=False, name=guarded_name(name, os.getpid()))
    start_guarded(process)
    return process


def _result_path(jobdir: str, rank: int) -> str:
    return os.path.join(jobdir, f"result{rank}.pkl")


def _worker_main(env: Environment, job: bytes) -> None:
    name_process(f"shoal worker {env.rank}")  # a training job's rank may be a server: run_rank
    set_environment(env)  # shoal's own code takes it as this object
    env.export()  # for user code that calls torch.distributed itself
    interface = loopback_gloo_interface()
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # only Gloo's variable says it
        os.environ["NCCL_SOCKET_IFNAME"] = interface  # and NCCL's, for its bootstrap sockets
    errdir = env.error_dir
    assert errdir is not None
    try:
        target, args = cloudpickle.loads(job)
        result = target(*args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Terminated:  # SIGTERM came before this rank could take it: it ends as it would
        _end_by_sigterm()  # have before it began to take it (the launcher's "a stop")
    except SystemExit as exc:
        # sys.exit(0) / sys.exit() is success; sys.exit(3) leaves with status 3, which the
        # parent reports as that exit code; sys.exit("text") is Python's "print, exit 1".
        if exc.code not in (None, 0):
            if isinstance(exc.code, int):
                raise
            record_failure(errdir, env.rank, exc)
            sys.exit(1)
        result = None
    except BaseException as exc:  # reported by the parent, one line
        record_failure(errdir, env.rank, exc)
        sys.exit(1)
    # Written whatever the value: it also tells the parent that this rank finished its work.
    tmp = _result_path(errdir, env.rank) + ".tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(result, f)
    os.replace(tmp, _result_path(errdir, env.rank))


def _end_by_sigterm() -> None:
    """End this process by SIGTERM's default action, as a rank that had not yet taken the
    signal ends: its launcher, asked to stop, reports a stop (status 143), not a failure."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)  # not reached: the signal ends the process first


def _wait_all(procs: list[Any], timeout: float) -> list[Any]:
    """Wait up to ``timeout`` seconds for all ``procs`` to exit; return those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if p.exitcode is None]
        remaining = deadline - time.monotonic()
        if not alive or remaining <= 0:
            return alive
        mp.connection.wait([p.sentinel for p in alive], timeout=remaining)


def stop_processes(procs: list[Any], grace: float) -> None:
    """Give workers ``grace`` seconds to exit by themselves, then SIGTERM, then SIGKILL."""
    alive = _wait_all(procs, grace)
    for p in alive:
        p.terminate()
        # A stopped process (SIGSTOP, a debugger) holds SIGTERM until it runs again.
        if p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
    for p in _wait_all(alive, 5.0):
        p.kill()
    _wait_all(procs, 5.0)
    for p in procs:
        p.join(timeout=0)


@dataclass(frozen=True)
class Lost:
    """What :func:`spawn` returns for a rank it was told to tolerate losing and lost: killed
    by a signal (``kill -9``, the OOM killer) before it finished."""

    rank: int
    exitcode: int
    after_s: float  # seconds after the start

    @property
    def status(self) -> str:
        return exit_status(self.exitcode)


def spawn(
    world_size: int,
    target: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    grace: float = 2.0,
    tolerate: Callable[[int], bool] | None = None,
    on_store: Callable[[int], None] | None = None,
    secret: bytes | None = None,
) -> list[Any]:
    """Run ``target(*args)`` in ``world_size`` fresh processes joined as one job on this machine.

    Each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT`` (a free port) and its :class:`~shoal.core.env.Environment`. ``target`` and ``args``
    travel cloudpickled (by value when not importable); the main program is not run again. Returns the
    ranks' results, or raises the root-cause failure, as :func:`_supervise` says (``grace``, ``tolerate``).
    SIGTERM to this process (on the main thread) is passed on to the workers and sets :func:`stop_requested`
    (training checkpoints and stops); while they start, it stops them and raises
    :class:`~shoal.errors.Terminated`. ``on_store(port)``: told the store's port before any rank starts
    (where joiners find it); ``secret``: the job's, sealing its store (fresh when ``None``)."""
    job = _pack_job(world_size, target, args)
    # Served here (loopback only): it outlives any worker, a dead rank 0 too.
    store = loopback_store(timeout=60.0, secret=secret)
    if on_store is not None:
        on_store(store.port)
    errdir = tempfile.mkdtemp(prefix="shoal-errors-")
    procs: list[BaseProcess] = []
    sigterm = Flag()  # a SIGTERM came while this call runs

    def forward_sigterm(signum: int, frame: Any) -> None:
        STOP.set()
        sigterm.set()
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, forward_sigterm) if on_main else None
    try:
        env = Environment(0, world_size, 0, world_size, "127.0.0.1", store.port, "local",
                          agent_store=True, error_dir=errdir, secret=store.secret_hex)
        _start_ranks(procs, env, job, sigterm)
        if STOP.is_set():  # a SIGTERM that came before this call
            forward_sigterm(signal.SIGTERM, None)
        try:
            return _supervise(procs, store, errdir, grace, tolerate)
        except WorkerError as exc:
            if sigterm.is_set() and exc.exit_code == -signal.SIGTERM:
                # Asked to stop, and a rank ended by that very signal (it was still starting,
                # before it could take SIGTERM as "checkpoint and stop"): a stop, not a crash.
                raise Terminated(f"stopped by SIGTERM before rank {exc.rank} could take it "
                                 "(it was still starting)") from None
            raise
    finally:
        stop_processes(procs, 0.0)
        shutil.rmtree(errdir, ignore_errors=True)
        del store
        if on_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _supervise(procs: list[BaseProcess], store: Any, errdir: str, grace: float,
               tolerate: Callable[[int], bool] | None) -> list[Any]:
    """Wait for the ranks ``procs`` (in rank order) to end. A rank that ended with status 0
    without leaving the job in order (``os._exit(0)``) is said to have left in the job's
    ``store``, so that the others need not wait for it at their end.

    Returns the ranks' return values in rank order (``None`` for a rank that returned
    nothing or left with ``sys.exit(0)`` or ``os._exit(0)``) once all exit cleanly. When one
    fails (an exception, a non-zero exit status, a signal), the others get ``grace`` seconds
    to notice and are then terminated, and a :class:`WorkerError` describing the root-cause
    failure is raised. Ctrl-C stops them all.

    ``tolerate(rank)``: whether the job goes on without ``rank`` when a signal kills it (an
    asynchronous job's workers); its result is then a :class:`Lost`, and how it ended is
    said in the store for the ranks that go on (:meth:`~shoal.core.comm.Comm.ended`). A tolerated rank that
    fails by itself (an exception, an exit status) still fails the job, as every rank
    runs the same code.
    """
    import torch.distributed as dist

    pending = list(procs)
    lost: dict[int, Lost] = {}
    started = time.monotonic()
    failed = False
    keys = dist.PrefixStore(key_prefix(0), store)  # the attempt of every rank spawned here
    while pending and not failed:
        mp.connection.wait([p.sentinel for p in pending], timeout=1.0)
        # One snapshot of the exit codes: a rank that dies between two reads of
        # ``exitcode`` must not leave ``pending`` without having been judged.
        codes = {procs.index(p): p.exitcode for p in pending}
        for rank, code in codes.items():
            if (code is not None and code < 0 and tolerate is not None and tolerate(rank)
                    and not _finished(errdir, rank)):
                lost[rank] = Lost(rank, code, time.monotonic() - started)
                keys.set(ended_key(rank), lost[rank].status)  # for the ranks that go on
            if code == 0 and not _finished(errdir, rank):
                say_gone(keys, rank, len(procs), "exited with status 0")
        failed = any(code not in (None, 0) and rank not in lost and not _finished(errdir, rank)
                     for rank, code in codes.items())
        if tolerate is not None:
            _end_left_out(procs, members_now(keys), errdir)
        pending = [procs[rank] for rank, code in codes.items() if code is None]
    if not failed:
        if tolerate is not None and len(lost) == len(procs):  # elastic: joiners may go on
            outlive(keys, len(procs), STALE, STOP.is_set)
        return _results(procs, errdir, lost)
    # Exit codes now, before shoal's own SIGTERMs blur who died first. A rank that exited
    # with status 0 before its work was done (os._exit(0)) is among them: the others' errors
    # may be the echoes of its leaving.
    exits = {r: p.exitcode for r, p in enumerate(procs)
             if p.exitcode is not None and not _finished(errdir, r) and r not in lost}
    finished = {r: os.path.getmtime(_result_path(errdir, r)) for r in range(len(procs))
                if _finished(errdir, r) and r not in lost}
    stop_processes(procs, grace)
    server = server_lost()
    if server is not None:  # every rank it forked died with it: none of them is the cause
        raise JobError(f"{server}; the workers it forked ended with it")
    raise root_cause(errdir, exits, finished)


def _end_left_out(procs: list[BaseProcess], members: list[int] | None, errdir: str) -> None:
    """Elastic: once every worker of the job's latest group that this launcher started
    finished (a joiner is its own ``shoal join``'s), end those left out of it (stopped, or
    too late to come back), which nobody waits for any more."""
    if members is None or not all(_finished(errdir, rank) for rank in members
                                  if rank < len(procs)):
        return
    for rank, p in enumerate(procs):
        if rank not in members and p.exitcode is None and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)


def _results(procs: list[BaseProcess], errdir: str, lost: dict[int, Lost]) -> list[Any]:
    """What each rank returned (``None`` for one that ended with ``os._exit(0)``, which
    leaves nothing), or how it was lost."""
    results = []
    server = server_lost() if any(p.exitcode != 0 for p in procs) else None
    if server is not None:
        log.warning(f"shoal: warning: {server} as the workers exited; their work was done")
    for rank, p in enumerate(procs):
        if rank in lost:
            results.append(lost[rank])
            continue
        if p.exitcode != 0 and server is None:
            # Its work is done and its results written; only the interpreter's own
            # teardown failed. Losing the job for that would lose good results.
            log.warning(f"shoal: warning: rank {rank} finished its work, then its process died "
                        f"while exiting ({exit_status(p.exitcode)})")
        results.append(_read_result(errdir, rank) if _finished(errdir, rank) else None)
    return results


def _pack_job(world_size: int, target: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """``target`` and ``args`` as the workers will get them, once ``world_size`` processes
    are known to fit this machine (:mod:`shoal.core.limits`); one-line errors otherwise."""
    if world_size < 1:
        raise ShoalError(f"need at least 1 worker, got {world_size}")
    check_processes("cannot start the workers", world_size)
    try:
        return cloudpickle.dumps((target, args))
    except Exception as exc:
        name = getattr(target, "__qualname__", repr(target))
        raise ShoalError(f"cannot send {name} and its arguments to the workers: "
                         f"{first_line(exc)}") from exc


def _start_ranks(procs: list[BaseProcess], job_env: Environment, job: bytes,
                 sigterm: Flag) -> None:
    """Start a process for each rank of ``job_env``'s job, in rank order, appending each to
    ``procs`` as it starts. A SIGTERM (``sigterm``) ends the start-up: nothing more starts,
    and :class:`Terminated` is raised; the caller stops those started."""
    for rank in range(job_env.world_size):
        if sigterm.is_set():
            break
        env = replace(job_env, rank=rank, local_rank=rank)
        procs.append(start_process(_worker_main, (env, job)))
    if sigterm.is_set():
        raise Terminated(f"stopped by SIGTERM while starting the workers ({len(procs)} of "
                         f"{job_env.world_size} started); nothing ran")


def _finished(jobdir: str, rank: int) -> bool:
    """Whether rank ``rank`` returned from its target (and wrote what it returned)."""
    return os.path.exists(_result_path(jobdir, rank))


def _read_result(jobdir: str, rank: int) -> Any:
    path = _result_path(jobdir, rank)
    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except Exception as exc:
        raise WorkerError(rank, f"could not read its return value here: {first_line(exc)}",
                          traceback="".join(traceback.format_exception(exc))) from exc
