"""The controller's side of a parallel session: worker processes, the process group, the
registry of objects that live on every worker, and the session's books.

Rank 0 is the calling process and computes its own share; ranks 1..n-1 are spawned workers
running the entry point :func:`shoal.fork` gives (``shoal.parallel.worker.worker_main``).
Tensors move only through torch.distributed (Gloo on CPU, NCCL for CUDA tensors). Commands
and per-call status travel through the session's :class:`~shoal.core.pool.Pool`, one pipe
per worker: a worker may wait for its next command for hours (a pipe has no timeout to
trip), a dead worker shows up at once as its process sentinel, and a small message on a
pipe costs tens of microseconds where a Gloo collective costs hundreds on a busy machine.

A :class:`~shoal.parallel.watcher.Watcher` interrupts a call whose worker dies. A session
that failed stays the current one, *broken*: every later call raises until :func:`fork`
starts a new session (or :func:`close` ends it). Everything the session listens on is bound
to loopback.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.env import default_threads
from shoal.core.failures import exit_status, first_line
from shoal.core.files import atomic_write
from shoal.core.group import join_group, loopback_gloo
from shoal.core.limits import check_processes, check_threads
from shoal.core.pool import Pool, WorkerLost
from shoal.core.processes import loopback_store
from shoal.core.timeline import Timeline, chrome_trace
from shoal.errors import ShoalError, WorkerError
from shoal.parallel import hostsums
from shoal.parallel.context import Meter
from shoal.parallel.protocol import OP_CLOSE
from shoal.parallel.registry import Registry
from shoal.parallel.watcher import Watcher


class ParallelSession:
    """A running set of workers; created by :func:`shoal.fork`, which passes the workers'
    entry point ``worker_main``. With ``trace`` (a path) every rank keeps its spans and
    :meth:`close` writes them there as one Chrome trace, one lane per rank."""

    def __init__(self, n: int, device: str = "cpu", timeout: float = 600.0,
                 threads: int | None = None, *, worker_main: Callable[..., None],
                 trace: str | os.PathLike[str] | None = None) -> None:
        if n < 1:
            raise ShoalError(f"shoal.fork needs at least 1 process, got {n}")
        check_processes(f"shoal.fork({n})", n - 1)  # rank 0 is this process
        check_threads("shoal.fork's threads", threads)
        if device not in ("cpu", "cuda"):
            raise ShoalError(f"unknown device {device!r}; choose cpu or cuda")
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ShoalError("shoal.fork(device='cuda'), but torch sees no CUDA GPU")
            if torch.cuda.device_count() < n:
                raise ShoalError(f"shoal.fork({n}, device='cuda') needs {n} GPUs, "
                                 f"{torch.cuda.device_count()} are visible")
        if n > 1 and dist.is_initialized():
            raise ShoalError("shoal.fork needs a process without a torch.distributed process group "
                             "(it starts its own)")
        self.trace = Path(trace) if trace is not None else None
        if self.trace is not None and not self.trace.parent.is_dir():
            raise ShoalError(f"shoal.fork: the trace's directory {self.trace.parent} does not exist")
        self.world_size = n
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.timeout = float(timeout)
        self.registry = Registry()
        self.meter = Meter(keep_events=self.trace is not None)
        self.defined: set[int] = set()  # function ids the workers know
        self.last_payload: dict[int, bytes] = {}
        self.closed = False
        self._threads_before = torch.get_num_threads()
        self.threads = default_threads(n) if threads is None else threads
        self.pool = Pool()  # the workers: rank r's process and pipe
        self.procs = self.pool.procs
        self._store: Any = None
        # Why the session broke (rank, or None for the controller's own abort; one line).
        self.broken: tuple[int | None, str] | None = None
        self.watcher = Watcher(self.procs)
        torch.set_num_threads(self.threads)
        if device == "cuda":
            torch.cuda.set_device(0)
        if n > 1:
            try:
                self._start(device, worker_main)
            except BaseException:
                self.abort()
                raise
        atexit.register(self.close)

    @property
    def timeline(self) -> Timeline:
        """Where rank 0's time in calls went (data, compute, comm; see :mod:`shoal.core.timeline`)."""
        return self.meter.timeline

    @property
    def bytes_sent(self) -> int:
        """Bytes of tensors rank 0 sent in calls and collectives."""
        return self.meter.bytes_sent

    # -- start and stop ---------------------------------------------------------------------
    def _start(self, device: str, worker_main: Callable[..., None]) -> None:
        # Bound to 127.0.0.1 (a plain TCPStore listens on every interface) and sealed with a
        # fresh secret, which the workers get with their arguments.
        self._store = loopback_store(max(self.timeout, 60.0))
        # Not daemonic, so a function may start processes of its own (a DataLoader's workers);
        # close() runs at exit and PR_SET_PDEATHSIG covers a controller that dies outright.
        # Workers never run the caller's main program: functions reach them by value.
        self.pool.start(worker_main, range(1, self.world_size),
                        (self.world_size, self._store.port, device, self.timeout, self.threads,
                         self.trace is not None, self._store.secret_hex), name="shoal-worker")
        # Wait until every worker has imported torch (a dead one shows at once), then join.
        # Starting is allowed a minute even under a short call timeout: a loaded machine
        # can take that long to import torch in n processes.
        self.recv_all(max(self.timeout, 60.0), what="start")
        # The controller is the user's own process: Gloo is pinned to loopback only while
        # it joins, and the user's GLOO_SOCKET_IFNAME comes back afterwards.
        with loopback_gloo():
            join_group(self._store, 0, self.world_size, device, self.timeout,
                       where="the parallel session")
            hostsums.join(device, self.timeout)  # with every worker: a collective
        self.recv_all(max(self.timeout, 60.0), what="join the process group")
        self.watcher.start()

    def begin_call(self) -> None:
        """Enter a call: from here until ``watcher.end_call()`` a dead worker interrupts it."""
        if not self.watcher.begin_call():  # died between calls
            raise self.failure()

    def close(self) -> None:
        """Stop the workers (they finish their current command first) and leave the group.
        Closing a broken session ends it too: calls run serially again. With ``trace``,
        write the trace."""
        self._end(grace=10.0)
        self._release()

    def abort(self, broken: tuple[int | None, str] | None = None) -> None:
        """Stop the workers now (terminate, then kill): after Ctrl-C or a broken protocol.
        ``broken``: (rank, why) of the failure; later calls raise until a new fork."""
        if not self.closed and self.broken is None:
            self.broken = broken or (None, "aborted")
        self._end(grace=0.0)

    def broken_error(self) -> ShoalError:
        """The error every use of a broken session raises (one line)."""
        rank, why = self.broken or (None, "closed")
        again = "call shoal.fork() again"
        if rank is None:
            return ShoalError(f"the parallel session was {why}; {again}")
        return WorkerError(rank, f"the parallel session is broken by rank {rank}'s failure ({why}); "
                                 f"{again}")

    def _end(self, grace: float) -> None:
        """Ask the workers to exit (when ``grace``; with ``trace`` they answer with their
        spans), give them ``grace`` seconds, then terminate and kill what is left."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(ValueError):
            atexit.unregister(self.close)
        lanes: dict[int, tuple[list[dict[str, Any]], int]] = {}
        try:
            if grace:
                with contextlib.suppress(WorkerLost):
                    self.pool.send_all(pickle.dumps((OP_CLOSE,)))
                if self.trace is not None:
                    got, _ = self.pool.gather(grace, fail_fast=False)
                    lanes = {rank: pickle.loads(books) for rank, books in got.items()}
            self.pool.stop(grace)
        finally:
            self._teardown()
        if self.trace is not None:
            try:
                self._write_trace(lanes)
            except ShoalError:
                if grace:  # an abort is on its way out with the error that caused it
                    raise

    def _write_trace(self, books: dict[int, tuple[list[dict[str, Any]], int]]) -> None:
        """Write every rank's spans as one Chrome trace, atomically (a failed write is one
        line, and leaves any earlier trace as it was)."""
        assert self.trace is not None
        lanes = [self.meter.timeline.chrome_events(0)] + [books[r][0] for r in sorted(books)]
        sent = {"0": self.meter.bytes_sent} | {str(r): books[r][1] for r in sorted(books)}
        text = json.dumps(chrome_trace(lanes, {"world_size": self.world_size, "device": str(self.device),
                                               "bytes_sent": sent}), separators=(",", ":"))
        atomic_write(self.trace, lambda f: f.write(text.encode()), what="trace")

    def _teardown(self) -> None:
        self.watcher.stop()
        self.pool.close()
        hostsums.leave()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._store = None
        torch.set_num_threads(self._threads_before)
        if self.broken is None:
            self._release()  # a broken session stays current, so that later calls raise

    def _release(self) -> None:
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None

    def __enter__(self) -> ParallelSession:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort((None, f"left by {exc_type.__name__}"))
            self._release()

    # -- messages ---------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.broken is not None:
            raise self.broken_error()
        if self.closed:
            raise ShoalError("this parallel session is closed; call shoal.fork() again")

    def send_all(self, msg: bytes) -> None:
        try:
            self.pool.send_all(msg)
        except WorkerLost as lost:
            raise self.failure(f"lost worker {lost.rank}") from None

    def recv_all(self, timeout: float, what: str = "answer") -> list[bytes]:
        """One message from every worker, in rank order; a dead or silent worker raises."""
        try:
            return self.pool.recv_all(timeout)
        except WorkerLost as lost:
            if not lost.timed_out:
                raise self.failure() from None
            why = f"did not {what} within {timeout:g} s"
            self.abort((lost.rank, why))
            raise WorkerError(lost.rank, f"{why} (raise shoal.fork(timeout=...) for longer calls)") from None

    def failure(self, fallback: str = "the parallel session broke") -> WorkerError:
        """Abort the session and describe why: the first worker that died, if any did."""
        dead = self.watcher.deaths(wait=2.0)
        if dead:
            rank = min(dead)
            why = f"worker process {exit_status(dead[rank])}"
        else:
            rank, why = 0, first_line(ShoalError(fallback))
        self.abort((rank, why))
        return WorkerError(rank, f"{why}; the parallel session is closed")


_CURRENT: ParallelSession | None = None


def current() -> ParallelSession | None:
    """The open session of this (controller) process, if any."""
    return _CURRENT if _CURRENT is not None and not _CURRENT.closed else None


def active() -> ParallelSession | None:
    """The session a call should use: the open one, or None (the call runs serially). A
    session that broke raises until :func:`fork` starts a new one or :func:`close` ends it."""
    session = _CURRENT
    if session is not None and session.broken is not None:
        raise session.broken_error()
    return session if session is not None and not session.closed else None


def make_current(session: ParallelSession) -> ParallelSession:
    """Make a newly started ``session`` the one calls use (:func:`shoal.fork` does)."""
    global _CURRENT
    _CURRENT = session
    return session


def close() -> None:
    """End the open parallel session, if any: its workers exit and its process group is left.

    A broken session is ended too; calls run serially again until the next `shoal.fork`.
    Without an open session it does nothing.
    """
    session = _CURRENT
    if session is not None:
        session.close()
