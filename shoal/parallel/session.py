"""The controller's side of a parallel session: worker processes, the process group, and
the registry of objects (modules, optimizers, data) that live on every worker.

Rank 0 is the calling process and computes its own share; ranks 1..n-1 are spawned workers
running :func:`shoal.parallel.worker.worker_main`. Tensors move only through
torch.distributed (Gloo on CPU, NCCL for CUDA tensors). Commands and per-call status travel
over one ``multiprocessing`` pipe per worker: a worker may wait for its next command for
hours (a pipe has no timeout to trip), a dead worker shows up at once as its process
sentinel, and a small message on a pipe costs tens of microseconds where a Gloo collective
costs hundreds on a busy machine.

A watcher thread waits on the workers' sentinels for the whole session. When a worker dies
during a call it kills the other workers (which releases rank 0 from any Gloo collective: its
peers' connections close) and, when the call runs on the main thread, wakes it with a signal
whose handler raises inside rank 0's share; the caller gets a :class:`WorkerError` naming the
dead rank at once instead of when its own share ends. A session that failed stays the
current one, *broken*: every later call raises until :func:`fork` starts a new session (or
:func:`close` ends it). Everything the session listens on is bound to loopback.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch import nn

from shoal.core.processes import (
    exit_status,
    first_line,
    loopback_gloo_interface,
    loopback_store,
    start_process,
    stop_processes,
)
from shoal.errors import ShoalError, WorkerError
from shoal.parallel.arrays import SharedArray

# Command opcodes (first element of every pickled message to a worker).
OP_CALL, OP_CLOSE = 1, 2
# Controller's verdict after the statuses came in.
GO, SKIP = b"\x01", b"\x00"

_state = threading.local()

# The signal the watcher sends the main thread when a worker dies mid-call: a real-time one,
# which nothing else uses (its default action would end the process, so its handler is
# installed once and left in place; it does nothing outside an interrupted call).
_WAKE = signal.SIGRTMAX - 3 if hasattr(signal, "SIGRTMAX") else signal.SIGUSR2


class Interrupted(BaseException):
    """Raised inside rank 0's share when a worker died during the call (never escapes a call:
    it becomes the :class:`WorkerError` naming that worker). A BaseException, so that a
    function's ``except Exception`` does not swallow it."""


def _on_wake(signum: int, frame: Any) -> None:
    session = _CURRENT
    if session is not None and session._wake_pending and in_function():
        session._wake_pending = False
        raise Interrupted


def _wake_handler_ready() -> bool:
    """Whether this thread can be woken: it is the main thread and the wake-up handler is
    installed (here, the first time, unless the program handles that signal itself)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        handler = signal.getsignal(_WAKE)
        if handler == signal.SIG_DFL:
            signal.signal(_WAKE, _on_wake)
            handler = _on_wake
    except (ValueError, OSError):
        return False
    return handler is _on_wake


@contextlib.contextmanager
def _loopback_gloo() -> Iterator[None]:
    """Pin the Gloo devices created inside to loopback (``GLOO_SOCKET_IFNAME=lo``) and give the
    caller's environment back afterwards: the controller is the user's own process."""
    interface = loopback_gloo_interface()
    values = {"GLOO_SOCKET_IFNAME": interface} if interface is not None else {}
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def in_function() -> bool:
    """True while this process runs a parallel function's body (every rank at once)."""
    return getattr(_state, "in_function", False)


class RemoteTraceback(Exception):
    """The text of a worker's traceback, chained under the :class:`WorkerError` it caused."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]).rstrip()


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of ``module`` by qualified name."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


class _RefPickler(cloudpickle.Pickler):  # by value: lambdas, closures, __main__ functions
    """Pickles registered objects (and their parameters and buffers) as references."""

    def __init__(self, file: io.BytesIO, registry: Registry, exempt: Any = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._registry = registry
        self._exempt = exempt

    def persistent_id(self, obj: Any) -> Any:
        if obj is self._exempt:
            return None
        return self._registry.ref(obj)


class Registry:
    """Objects that exist on every worker, by id. Auto-registers nn.Modules, optimizers and
    :class:`SharedArray` the first time they are pickled for a worker; sends each one once."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}  # id(obj) -> oid
        self._objs: dict[int, Any] = {}  # oid -> obj (strong: keeps id(obj) unique)
        self._tensors: dict[int, tuple[int, str]] = {}  # id(tensor) -> (oid of module, name)
        self._next = 1
        self.pending: list[tuple[int, str, bytes]] = []  # definitions not yet sent

    def dumps(self, obj: Any, exempt: Any = None) -> bytes:
        buf = io.BytesIO()
        _RefPickler(buf, self, exempt).dump(obj)
        return buf.getvalue()

    def register(self, obj: Any) -> int:
        if id(obj) in self._ids:
            return self._ids[id(obj)]
        if isinstance(obj, torch.optim.Optimizer):
            self._check_optimizer(obj)
        oid = self._next
        self._next += 1
        if isinstance(obj, SharedArray):
            kind, payload = "data", pickle.dumps(obj.handle())
        else:
            kind, payload = "object", self.dumps(obj, exempt=obj)
        self._ids[id(obj)] = oid
        self._objs[oid] = obj
        self.pending.append((oid, kind, payload))
        if isinstance(obj, nn.Module):
            for name, t in module_tensors(obj).items():
                self._tensors.setdefault(id(t), (oid, name))
        return oid

    def _check_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if self._tensor_ref(p) is None:
                    raise ShoalError(
                        "an optimizer reached the workers before its model: pass the model to the "
                        "parallel function (or call shoal.replicate(model)) before the optimizer"
                    )

    def _tensor_ref(self, t: torch.Tensor) -> tuple[int, str] | None:
        ref = self._tensors.get(id(t))
        if ref is None and self._tensors is not None:
            # A module's buffer may have been replaced by a new tensor since registration.
            for oid, obj in self._objs.items():
                if isinstance(obj, nn.Module):
                    for name, u in module_tensors(obj).items():
                        self._tensors.setdefault(id(u), (oid, name))
            ref = self._tensors.get(id(t))
        return ref

    def ref(self, obj: Any) -> Any:
        """The persistent id of ``obj``, or None to pickle it by value."""
        oid = self._ids.get(id(obj))
        if oid is not None:
            return ("obj", oid)
        if isinstance(obj, (nn.Module, torch.optim.Optimizer, SharedArray)):
            return ("obj", self.register(obj))
        if isinstance(obj, torch.Tensor):
            ref = self._tensors.get(id(obj))
            if ref is not None:
                return ("tensor", *ref)
        return None

    def knows(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (as of registration) a parameter or buffer of a replicated module."""
        return id(t) in self._tensors

    def is_replicated_tensor(self, t: torch.Tensor) -> bool:
        return self._tensor_ref(t) is not None

    def take_pending(self) -> list[tuple[int, str, bytes]]:
        out, self.pending = self.pending, []
        return out


class Session:
    """A running set of workers; created by :func:`shoal.fork`."""

    def __init__(self, n: int, device: str = "cpu", timeout: float = 600.0,
                 threads: int | None = None) -> None:
        if n < 1:
            raise ShoalError(f"shoal.fork needs at least 1 process, got {n}")
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
        self.world = n
        self.rank = 0
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.timeout = float(timeout)
        self.registry = Registry()
        self.defined: set[int] = set()  # function ids the workers know
        self.last_payload: dict[int, bytes] = {}
        self.closed = False
        self._threads_before = torch.get_num_threads()
        if threads is None:
            threads = max(1, len(os.sched_getaffinity(0)) // n)
        self.threads = threads
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._store: Any = None
        # Why the session broke (rank, or None for the controller's own abort; one line).
        self.broken: tuple[int | None, str] | None = None
        # The watcher's state, guarded by _lock: the first dead workers seen (rank -> exit
        # code, taken before anyone kills the rest), the thread inside a call, if any.
        self._lock = threading.Lock()
        self._dead: dict[int, int] | None = None
        self._call_thread: int | None = None
        self._wake_ok = False  # the calling thread can be woken by a signal
        self._wake_pending = False
        self._watcher: threading.Thread | None = None
        self._stop_r, self._stop_w = -1, -1
        torch.set_num_threads(threads)
        if device == "cuda":
            torch.cuda.set_device(0)
        if n > 1:
            try:
                self._start(device)
            except BaseException:
                self.abort()
                raise
        atexit.register(self.close)

    # -- start and stop ---------------------------------------------------------------------
    def _start(self, device: str) -> None:
        from shoal.parallel.worker import worker_main

        td = timedelta(seconds=self.timeout)
        # Bound to 127.0.0.1: a plain TCPStore listens on every interface, unauthenticated.
        self._store = loopback_store(max(self.timeout, 60.0))
        # Not daemonic, so a function may start processes of its own (a DataLoader's workers);
        # close() runs at exit and PR_SET_PDEATHSIG covers a controller that dies outright.
        # Workers never run the caller's main program: functions reach them by value.
        for rank in range(1, self.world):
            ours, theirs = mp.Pipe()
            p = start_process(worker_main, (rank, self.world, self._store.port, device, theirs,
                                            self.timeout, self.threads),
                              name=f"shoal-worker-{rank}")
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        # Wait until every worker has imported torch (a dead one shows at once), then join.
        # Starting is allowed a minute even under a short call timeout: a loaded machine
        # can take that long to import torch in n processes.
        self.recv_all(max(self.timeout, 60.0), what="start")
        backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
        with _loopback_gloo():
            dist.init_process_group(backend, store=self._store, rank=0, world_size=self.world,
                                    timeout=td)
        self.recv_all(max(self.timeout, 60.0), what="join the process group")
        self._stop_r, self._stop_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="shoal-watcher", daemon=True)
        self._watcher.start()

    # -- the watcher ------------------------------------------------------------------------
    def _watch(self) -> None:
        """Wait for a worker to die; during a call, stop the rest and interrupt rank 0."""
        sentinels = [p.sentinel for p in self.procs]
        while not self.closed:
            ready = mp.connection.wait([self._stop_r, *sentinels], timeout=5.0)
            if self._stop_r in ready or not ready:
                continue
            with self._lock:
                if self._deaths() is None:
                    continue  # exit code not readable yet (another thread is reaping it)
                if self._call_thread is not None:
                    for p in self.procs:  # closes rank 0's connections: no collective waits on
                        if p.exitcode is None:
                            p.kill()
                    if self._wake_ok:
                        self._wake_pending = True
                        signal.pthread_kill(self._call_thread, _WAKE)
            return  # one death breaks the session; the rest is the caller's to handle

    def _deaths(self) -> dict[int, int] | None:
        """The first dead workers (rank -> exit code); recorded the first time any is seen,
        before the others are killed. Called with ``_lock`` held."""
        if self._dead is None:
            dead = {r: p.exitcode for r, p in enumerate(self.procs, start=1) if p.exitcode is not None}
            self._dead = dead or None
        return self._dead

    def begin_call(self) -> None:
        """Enter a call: from here until :meth:`end_call` a dead worker interrupts it."""
        wake = _wake_handler_ready()
        with self._lock:
            dead = self._dead  # the watcher records a death between calls
            if dead is None:
                self._call_thread = threading.get_ident()
                self._wake_ok = wake
        if dead is not None:  # died between calls
            raise self.failure()

    def end_call(self) -> None:
        with self._lock:
            self._call_thread = None
            self._wake_ok = self._wake_pending = False

    def check_alive(self) -> None:
        """Before each slice of rank 0's share: stop if a worker died meanwhile."""
        if self._dead is not None:
            self._wake_pending = False
            raise Interrupted

    def close(self) -> None:
        """Stop the workers (they finish their current command first) and leave the group.
        Closing a broken session ends it too: calls run serially again."""
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
        """Ask the workers to exit (when ``grace``), give them ``grace`` seconds, then
        terminate and kill what is left."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(ValueError):
            atexit.unregister(self.close)
        try:
            if grace:
                for conn in self.conns:
                    with contextlib.suppress(OSError):
                        conn.send_bytes(pickle.dumps((OP_CLOSE,)))
            stop_processes(self.procs, grace)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        if self._watcher is not None:
            with contextlib.suppress(OSError):
                os.write(self._stop_w, b"x")
            if self._watcher is not threading.current_thread():
                self._watcher.join(timeout=10.0)
            os.close(self._stop_r)
            os.close(self._stop_w)
            self._watcher = None
        for conn in self.conns:
            conn.close()
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

    def __enter__(self) -> Session:
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
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(msg)
            except OSError:
                raise self.failure(f"lost worker {rank}") from None

    def recv_all(self, timeout: float, what: str = "answer") -> list[bytes]:
        """One message from every worker, in rank order; a dead or silent worker raises."""
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        index = {conn: r for r, conn in enumerate(self.conns, start=1)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        while len(got) < len(self.conns):
            waiting = [c for c, r in index.items() if r not in got]
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(r for r in index.values() if r not in got)
                why = f"did not {what} within {timeout:g} s"
                self.abort((missing[0], why))
                raise WorkerError(missing[0], f"{why} (raise shoal.fork(timeout=...) for longer calls)")
            ready = mp.connection.wait(waiting + list(sentinels), timeout=left)
            for obj in ready:
                if obj in sentinels:
                    continue
                with contextlib.suppress(EOFError, OSError):
                    got[index[obj]] = obj.recv_bytes()
            if any(s in ready for s in sentinels):
                raise self.failure()
        return [got[r] for r in range(1, self.world)]

    def failure(self, fallback: str = "the parallel session broke") -> WorkerError:
        """Abort the session and describe why: the first worker that died, if any did."""
        deadline = time.monotonic() + 2.0
        while True:
            with self._lock:
                dead = self._deaths()
            if dead is not None or time.monotonic() >= deadline:
                break
            mp.connection.wait([p.sentinel for p in self.procs], timeout=0.1)
        if dead:
            rank = min(dead)
            why = f"worker process {exit_status(dead[rank])}"
        else:
            rank, why = 0, first_line(ShoalError(fallback))
        self.abort((rank, why))
        return WorkerError(rank, f"{why}; the parallel session is closed")


_CURRENT: Session | None = None


def current() -> Session | None:
    """The open session of this (controller) process, if any."""
    return _CURRENT if _CURRENT is not None and not _CURRENT.closed else None


def active() -> Session | None:
    """The session a call should use: the open one, or None (the call runs serially). A
    session that broke raises until :func:`fork` starts a new one or :func:`close` ends it."""
    session = _CURRENT
    if session is not None and session.broken is not None:
        raise session.broken_error()
    return session if session is not None and not session.closed else None


def fork(n: int, device: str = "cpu", *, timeout: float = 600.0, threads: int | None = None) -> Session:
    """Start ``n - 1`` workers; this process is rank 0 and computes its share too.

    ``device``: ``cpu`` (Gloo) or ``cuda`` (rank r on GPU r; NCCL for tensors). ``timeout``
    bounds every wait in the session, including a call waiting for the slowest worker.
    ``threads`` sets each process's torch threads (default: cores divided by ``n``). Use it
    as a context manager, or end it with :func:`close`. Workers never run the main program
    (a script needs no ``if __name__ == "__main__":`` guard; stdin, ``-c`` and a REPL work):
    functions reach them by value. A worker that dies ends the call it is in at once; the
    session is then broken: later calls raise until ``fork`` is called again (or
    :func:`close`). The session listens on loopback only.
    """
    global _CURRENT
    if in_function():
        raise ShoalError("shoal.fork cannot be called inside a parallel function")
    if current() is not None:
        raise ShoalError("a parallel session is already open; call shoal.close() first")
    _CURRENT = Session(n, device, timeout, threads)
    return _CURRENT


def close() -> None:
    """End the open parallel session, if any: workers exit, the process group is left. A
    broken session is ended too (calls run serially again)."""
    session = _CURRENT
    if session is not None:
        session.close()
