"""The controller's side of a parallel session: worker processes, the process group, and
the registry of objects (modules, optimizers, data) that live on every worker.

Rank 0 is the calling process and computes its own share; ranks 1..n-1 are spawned workers
running :func:`shoal.parallel.worker.worker_main`. Tensors move only through
torch.distributed (Gloo on CPU, NCCL for CUDA tensors). Commands and per-call status travel
over one ``multiprocessing`` pipe per worker: a worker may wait for its next command for
hours (a pipe has no timeout to trip), a dead worker shows up at once as its process
sentinel, and a small message on a pipe costs tens of microseconds where a Gloo collective
costs hundreds on a busy machine.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import threading
import time
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch import nn

from shoal.errors import ShoalError, WorkerError
from shoal.parallel.arrays import SharedArray
from shoal.processes import exit_status, start_process, stop_processes

# Command opcodes (first element of every pickled message to a worker).
OP_CALL, OP_CLOSE = 1, 2
# Controller's verdict after the statuses came in.
GO, SKIP = b"\x01", b"\x00"

_state = threading.local()


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
        start = timedelta(seconds=max(self.timeout, 60.0))
        self._store = dist.TCPStore("127.0.0.1", 0, self.world, True, timeout=start,
                                    wait_for_workers=False)
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
        dist.init_process_group(backend, store=self._store, rank=0, world_size=self.world, timeout=td)
        self.recv_all(max(self.timeout, 60.0), what="join the process group")

    def close(self) -> None:
        """Stop the workers (they finish their current command first) and leave the group."""
        self._end(grace=10.0)

    def abort(self) -> None:
        """Stop the workers now (terminate, then kill): after Ctrl-C or a broken protocol."""
        self._end(grace=0.0)

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
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._store = None
        torch.set_num_threads(self._threads_before)
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- messages ---------------------------------------------------------------------------
    def check_open(self) -> None:
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
                self.abort()
                raise WorkerError(missing[0], f"did not {what} within {timeout:g} s "
                                  "(raise shoal.fork(timeout=...) for longer calls)")
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
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.procs):
            mp.connection.wait([p.sentinel for p in self.procs], timeout=0.1)
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        self.abort()
        if dead:
            rank, code = dead[0]
            return WorkerError(rank, f"worker process {exit_status(code)}; the parallel session "
                                     "is closed")
        return WorkerError(0, f"{fallback}; the parallel session is closed")


_CURRENT: Session | None = None


def current() -> Session | None:
    """The open session of this (controller) process, if any."""
    return _CURRENT if _CURRENT is not None and not _CURRENT.closed else None


def fork(n: int, device: str = "cpu", *, timeout: float = 600.0, threads: int | None = None) -> Session:
    """Start ``n - 1`` workers; this process is rank 0 and computes its share too.

    ``device``: ``cpu`` (Gloo) or ``cuda`` (rank r on GPU r; NCCL for tensors). ``timeout``
    bounds every wait in the session, including a call waiting for the slowest worker.
    ``threads`` sets each process's torch threads (default: cores divided by ``n``). Use it
    as a context manager, or end it with :func:`close`. Workers never run the main program
    (a script needs no ``if __name__ == "__main__":`` guard; stdin, ``-c`` and a REPL work):
    functions reach them by value.
    """
    global _CURRENT
    if in_function():
        raise ShoalError("shoal.fork cannot be called inside a parallel function")
    if current() is not None:
        raise ShoalError("a parallel session is already open; call shoal.close() first")
    _CURRENT = Session(n, device, timeout, threads)
    return _CURRENT


def close() -> None:
    """End the open parallel session, if any: workers exit, the process group is left."""
    session = current()
    if session is not None:
        session.close()
