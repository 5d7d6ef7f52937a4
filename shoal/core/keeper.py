"""``--elastic`` under an outside launcher (torchrun, mpirun, Slurm): each process it
started *keeps* its rank, running the rank's work in a child process of its own.

torchrun's agent (mpirun and srun alike) takes any worker process that dies for a failed
job: it ends every worker and restarts them all (``--max-restarts``) or fails. A worker
lost to an elastic job (killed, the OOM killer) must not look like that. So the process
the launcher started (the *keeper*) starts the rank's work in a child that dies with it
(:func:`start_child`: forked from the keeper itself, which imported torch already, before
it runs a thread or connects to the job's store), and judges how the child ended
(:func:`keep_rank`):

- it returned: its result is the keeper's (the summary, for the rank that wrote it);
- it failed with an error: the keeper raises that line, as the rank would have (the
  launcher then ends the job: every rank runs the same code);
- a signal killed it, and the job goes on without its rank: the keeper says so in the job's
  store (:func:`~shoal.core.waits.ended_key`, as shoal's launcher does: the members leave it
  out at once instead of after the heartbeat timeout) and waits, beating nothing, until the
  job says it finished (:data:`~shoal.core.waits.DONE_KEY`, set once the summary is written:
  status 0) or every worker's rank ended and no worker that joined the job trains on (one
  line, status 1). A child left out of the job's latest group (stopped, too late to come
  back) is ended once the job finished.

SIGTERM to the keeper goes to the child (it stops at the job's next step, with a
checkpoint) and marks the keeper stopped too.

Under mpirun no launcher serves the job's store: rank 0's keeper does (its child is a client
like the others), so it stays until every keeper said it is done with the store
(:data:`KEPT_KEY`, at most :data:`LINGER_S` seconds): a keeper still waiting for the end
would otherwise find the store gone and fail a job that finished.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from shoal.core.failures import exit_status
from shoal.core.guard import (
    die_with_parent,
    guarded_name,
    name_process,
    show_threads_on_usr1,
    title_of,
)
from shoal.core.outlive import STALE, live_joiners
from shoal.core.processes import start_process
from shoal.core.starting import server_lost, start_method
from shoal.core.stop import request_stop, stop_requested
from shoal.core.waits import DONE_KEY, ended_key, members_now
from shoal.errors import JobError, ShoalError

log = logging.getLogger("shoal.keeper")

#: Counts the keepers done with the job's store (rank 0's keeper serves it under mpirun).
KEPT_KEY = "keepers/done"
#: Seconds a keeper that serves the store waits at most for the others to be done with it.
LINGER_S = 30.0
#: Seconds between two looks of a keeper at its child and at the job's store.
POLL_S = 1.0


def _child_main(target: Callable[..., Any], args: tuple[Any, ...], report: Any) -> None:
    """The child: ``target(*args)``; what it returned, or its failure in one line, goes back
    to the keeper; then the process leaves at once (no teardown that could wait)."""
    try:
        result = target(*args)
    except BaseException as exc:  # noqa: BLE001 - told to the keeper, whatever it is
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        shown = line if isinstance(exc, ShoalError) else f"{type(exc).__name__}: {line}"
        said = ("failed", shown, isinstance(exc, ShoalError) and exc.user_error)
        code = 1
    else:
        said, code = ("returned", result), 0
    with contextlib.suppress(OSError):  # a keeper lost (killed) is told nothing
        report.send(said)
        report.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Child:
    """A rank's work running in a child of this process (:func:`start_child`); SIGTERM here
    is passed on to it until :meth:`release`."""

    def __init__(self, process: BaseProcess, report: Connection) -> None:
        self.process, self.report = process, report

        def forward(*_: Any) -> None:
            request_stop()
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(process.pid, signal.SIGTERM)  # type: ignore[arg-type]

        self._previous = signal.signal(signal.SIGTERM, forward)
        self._held = True

    def release(self) -> None:
        """Give SIGTERM back to the handler it had before the child started (once)."""
        if self._held:
            self._held = False
            signal.signal(signal.SIGTERM, self._previous)

    def end(self) -> None:
        """End the child now (SIGKILL) if it runs, and wait for it: this keeper failed
        before it could keep it."""
        with contextlib.suppress(ProcessLookupError, TypeError):
            if self.process.exitcode is None:
                os.kill(self.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.process.join()
        self.release()


def _forkable() -> bool:
    """Whether this process may fork its child: Linux, one thread only (a fork copies no
    lock another thread holds, no pool whose threads the child would lack) and no CUDA set
    up (the child could not use it)."""
    import torch

    if start_method() != "forkserver" or torch.cuda.is_initialized():
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1 and threading.active_count() == 1
    except OSError:
        return False


def start_child(target: Callable[..., Any], args: tuple[Any, ...], name: str,
                fork: bool = False) -> Child:
    """Start ``target(*args)`` in a child process that dies with this one. ``fork``: forked
    from this very process (it imported torch already: no server, no interpreter to start)
    where that is safe (:func:`_forkable`), before it made any connection (the child would
    share it); else :func:`~shoal.core.processes.start_process`."""
    theirs, mine = mp.get_context("spawn").Pipe(duplex=False)
    if fork and _forkable():
        process: BaseProcess = mp.get_context("fork").Process(
            target=_forked_main, args=(os.getpid(), title_of(name), target, args, mine, theirs),
            name=guarded_name(name, os.getpid()), daemon=False)
        process.start()
    else:
        process = start_process(_child_main, (target, args, mine), name=name)
    mine.close()
    return Child(process, theirs)


def _forked_main(keeper: int, title: str, target: Callable[..., Any], args: tuple[Any, ...],
                 report: Connection, theirs: Connection) -> None:
    """A child forked by :func:`start_child`: tied to the keeper first (it dies with it, at
    once if it is gone: :func:`~shoal.core.guard.die_with_parent`), then as a child of
    :func:`~shoal.core.processes.start_process` is: named, SIGTERM and SIGINT as a fresh
    process has them, ``kill -USR1`` showing its threads; then :func:`_child_main`."""
    die_with_parent(keeper)
    theirs.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the keeper's, whatever it had
    signal.signal(signal.SIGINT, signal.default_int_handler)
    show_threads_on_usr1()
    name_process(title)
    _child_main(target, args, report)


def run_child(target: Callable[..., Any], args: tuple[Any, ...], name: str,
              poll: Callable[[Any], None] | None = None) -> tuple[int | None, tuple | None]:
    """Run ``target(*args)`` in a child process that dies with this one and wait for it,
    calling ``poll(process)`` every :data:`POLL_S` s meanwhile; SIGTERM here is passed on.
    Returns its exit code and its report: ``("returned", value)``, ``("failed", line,
    user_error)``, or ``None`` when it ended without one (killed)."""
    return wait_child(start_child(target, args, name), poll)


def wait_child(child: Child, poll: Callable[[Any], None] | None = None
               ) -> tuple[int | None, tuple | None]:
    """Wait for ``child`` to end, as :func:`run_child` says."""
    process, theirs = child.process, child.report
    report = None
    try:
        while process.is_alive():
            if theirs.poll(POLL_S):
                with contextlib.suppress(EOFError):
                    report = theirs.recv()
                process.join()
            elif poll is not None:
                poll(process)
        process.join()
        if report is None and theirs.poll():
            with contextlib.suppress(EOFError):
                report = theirs.recv()
    finally:
        child.release()
    return process.exitcode, report


def keep_rank(rank: int, keys: Any, child: Child, workers: range, tolerated: bool,
              serving: bool = False) -> Any:
    """Keep ``rank`` of a job whose store (under this attempt's prefix) is ``keys``: its
    work in ``child`` (:func:`start_child`); ``tolerated``: the job goes on when a signal kills
    it (``workers``: the ranks the job may lose, all of them lost is the job lost, and
    ``workers.stop`` the job's ranks); ``serving``: this keeper serves the store."""
    name_process(f"shoal keeper {rank}")
    try:
        return _keep(rank, keys, child, workers, tolerated)
    finally:
        with contextlib.suppress(Exception):  # a store gone: nobody waits for this keeper
            keys.add(KEPT_KEY, 1)
        if serving:
            _linger(keys, workers.stop)


def _linger(keys: Any, ranks: int) -> None:
    """Wait (at most :data:`LINGER_S` s) until the keepers of all ``ranks`` are done with
    the store this keeper serves."""
    deadline = time.monotonic() + LINGER_S
    with contextlib.suppress(Exception):
        while keys.add(KEPT_KEY, 0) < ranks and time.monotonic() < deadline:
            time.sleep(POLL_S)


def _keep(rank: int, keys: Any, child: Child, workers: range, tolerated: bool) -> Any:
    ended: list[bool] = []

    def left_out(process: Any) -> None:  # once the job finished, a child it left out ends
        if not ended and keys.check([DONE_KEY]) and rank not in (members_now(keys) or [rank]):
            ended.append(True)
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(process.pid, signal.SIGKILL)

    code, report = wait_child(child, left_out)
    if report is not None and report[0] == "failed":
        raise (ShoalError if report[2] else JobError)(report[1])
    if code == 0:
        return report[1] if report is not None else None
    if ended:  # left out, and ended here once the job finished
        return None
    if stop_requested():  # SIGTERM here, passed on: the job stops, nothing goes on to wait for
        return None
    if code is None or code >= 0 or not tolerated:
        raise JobError(f"rank {rank}: process {exit_status(code or 1)}")
    how = exit_status(code)
    keys.set(ended_key(rank), how)  # for the ranks that go on
    server = server_lost(0.5)  # its death signal: the server that forked it was killed
    log.warning(f"shoal: rank {rank} {how}{f' ({server})' if server else ''}; the job goes on "
                "without it (--elastic)")
    return _wait_for_end(keys, workers)


def _wait_for_end(keys: Any, workers: range) -> None:
    """Wait until the job says it finished, or every one of its ``workers`` ended and no
    worker that joined it (ids from ``workers.stop`` on, as under shoal's launcher:
    :func:`~shoal.core.outlive.live_joiners`) trains on."""
    beats: dict[int, tuple[int, float]] = {}
    while True:
        try:
            if keys.check([DONE_KEY]):
                return
            gone = [r for r in workers if keys.check([ended_key(r)])]
            joined = len(gone) == len(workers) and live_joiners(keys, workers.stop, STALE, beats)
        except Exception as exc:  # the store's host is gone: so is the job
            raise JobError(f"the job's store went away before the job said it finished ({exc})"
                           ) from None
        if len(gone) == len(workers) and not joined:
            how = "; ".join(f"rank {r} {keys.get(ended_key(r)).decode()}" for r in gone)
            raise JobError(f"every worker was lost ({how}); the job ends with them")
        time.sleep(POLL_S)


__all__ = ["Child", "keep_rank", "run_child", "start_child", "wait_child"]
