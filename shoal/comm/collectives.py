"""Process-group set-up and the timed collectives every strategy uses.

Every rank of a job of several processes also runs a watchdog on the job's store
(:class:`_Watchdog`): it ends the rank within a second when another rank reports a failure,
and names a rank that stopped responding (no heartbeat for ``heartbeat_timeout`` seconds)
instead of letting the job wait out the collectives' ``timeout``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shoal.errors import ShoalError
from shoal.processes import EXIT_ABORTED, Environment, first_line
from shoal.timeline import Timeline

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: Gloo has no AVG
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}

_ABORT_KEY = "abort"
_HUNG = "stopped responding"  # how a hung rank's report begins

_T = TypeVar("_T")


def _reduce_op(op: str) -> dist.ReduceOp:
    try:
        return _OPS[op]
    except KeyError:
        raise ShoalError(f"unknown reduce op {op!r}; choose from {', '.join(_OPS)}") from None


class Handle:
    """A collective in flight. :meth:`wait` blocks and books the waiting as communication."""

    def __init__(self, comm: Comm, work: Any, tensor: torch.Tensor, op: str, name: str) -> None:
        self._comm, self._work, self._tensor, self._op, self._name = comm, work, tensor, op, name

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with self._comm.timeline.span("comm", self._name):
                self._work.wait()
            self._work = None
            if self._op == "avg":
                self._tensor.div_(self._comm.world_size)
        return self._tensor


class Comm:
    """This process's view of the job: rank, world size, device and timed collectives.

    With ``world_size == 1`` and no process group every collective returns its input, so
    strategies need no special case for a single process. With more ranks and a ``store``
    (the job's rendezvous store), a :class:`_Watchdog` ends this process when another rank
    fails or stops responding; ``heartbeat_timeout`` (seconds, ``None``: never) is how long
    a rank may go without a heartbeat before it is reported as hung.
    """

    def __init__(
        self,
        env: Environment,
        device: torch.device,
        timeline: Timeline | None = None,
        store: dist.Store | None = None,
        heartbeat_timeout: float | None = 10.0,
    ) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.device = device
        self.timeline = timeline or Timeline()
        self.bytes_sent = 0  # payload handed to collectives by this rank during training
        self.calls = 0
        self._store = dist.PrefixStore(_key_prefix(), store) if store is not None else None
        self.aborted = False  # this rank called abort(): nobody will wait for it at close()
        self._watchdog: _Watchdog | None = None
        if store is not None and self.world_size > 1:
            self._watchdog = _Watchdog(self, store, heartbeat_timeout)

    @property
    def active(self) -> bool:
        """True when there are other ranks to talk to."""
        return self.world_size > 1 and dist.is_initialized()

    # -- accounting -------------------------------------------------------------------------
    def count(self, nbytes: int, calls: int = 1) -> None:
        """Book ``nbytes`` of payload sent by a collective issued outside this class."""
        self.bytes_sent += int(nbytes)
        self.calls += calls

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", name: str = "allreduce") -> torch.Tensor:
        """Reduce ``tensor`` in place across ranks (``avg`` divides by the world size)."""
        return self.all_reduce_async(tensor, op, name).wait()

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum", name: str = "allreduce") -> Handle:
        """Start an in-place all-reduce; the returned handle's ``wait()`` finishes it."""
        red = _reduce_op(op)
        if not self.active:
            return Handle(self, None, tensor, op, name)
        self.count(tensor.numel() * tensor.element_size())
        with self.timeline.span("comm", name):
            work = dist.all_reduce(tensor, op=red, async_op=True)
        return Handle(self, work, tensor, op, name)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, name: str = "broadcast") -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s."""
        if self.active:
            self.count(tensor.numel() * tensor.element_size())
            with self.timeline.span("comm", name):
                dist.broadcast(tensor, src=src)
        return tensor

    def barrier(self) -> None:
        if self.active:
            with self.timeline.span("wait", "barrier"):
                dist.barrier()

    # -- bookkeeping collectives (metrics, checkpoints): not booked as training traffic -----
    def reduce_values(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """All-reduce a few Python numbers (metrics); returns the reduced list."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.active:
            dist.all_reduce(t, op=_reduce_op(op))
            if op == "avg":
                t /= self.world_size
        return t.tolist()

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Pickle-gather ``obj`` from every rank to ``dst`` (others get ``None``)."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every rank and return it."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    # -- failure handling -------------------------------------------------------------------
    def abort(self, message: str) -> None:
        """Tell every other rank that this one failed, so they exit instead of waiting.

        The first report stands (a later one is most likely its echo). A rank that the job
        declared hung while it did not run leaves here at once, without a report of its own:
        what it raises on waking up is the echo of being left behind.
        """
        self.aborted = True  # first: this rank's watchdog must not take the report for another's
        if self._store is None:
            return
        first = (message.strip().splitlines() or ["failed"])[0][:300]
        report = f"rank {self.rank}: {first}"
        try:
            standing = self._store.compare_set(_ABORT_KEY, "", report).decode()
        except Exception:  # the store may be gone already; the launcher still reaps us
            return
        if standing != report and standing.startswith(f"rank {self.rank}: {_HUNG}"):
            os._exit(EXIT_ABORTED)

    def close(self) -> None:
        """Wait for every rank, stop the watchdog and leave the process group.

        After :meth:`abort` it does not wait: the other ranks are on their way out, and a
        barrier would only hold this one until the timeout.
        """
        finished = False
        try:
            if self.active and not self.aborted:
                dist.barrier()
                finished = True
        finally:
            if self._watchdog is not None:
                self._watchdog.stop(timeout=5.0)
            try:
                if finished and self.active:
                    # Rank 0 may host the store: it must not exit while another rank's
                    # watchdog may still be asking it. A store call cut off while the
                    # interpreter shuts down ends the process in std::terminate (signal 6).
                    dist.barrier()
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()


def _key_prefix() -> str:
    """Where shoal's keys live in the job's store: ``shoal/<attempt>``.

    torchrun restarts a failed job (``--max-restarts``) with the same agent and, possibly, the
    same store; the attempt number (``TORCHELASTIC_RESTART_COUNT``) keeps an old attempt's
    abort report and heartbeats from ending the new attempt.
    """
    return f"shoal/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _name_os_thread(name: str) -> None:
    """Name the calling thread where ``ps -L``, ``top -H`` and ``/proc/PID/task`` show it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15])  # PR_SET_NAME


def _record_hung(errdir: str, rank: int, message: str, noticed_by: int) -> None:
    """Write rank ``rank``'s failure report for shoal's launcher (it cannot write its own).

    The same fields as :func:`shoal.processes.record_failure`, as the root cause (primary).
    A report the rank wrote itself is kept.
    """
    info = {
        "rank": rank,
        "time": time.time(),
        "type": "TimeoutError",
        "message": message,
        "primary": True,
        "user_error": False,
        "traceback": f"(no traceback: rank {rank} did not run; rank {noticed_by}'s watchdog "
                     f"saw its heartbeat stop)\n",
    }
    final = os.path.join(errdir, f"rank{rank}.json")
    tmp = os.path.join(errdir, f".hung{rank}.by{noticed_by}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(info, f)
        try:
            os.link(tmp, final)  # atomic, and never over the rank's own report
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            if not os.path.exists(final):
                os.replace(tmp, final)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


class _Watchdog:
    """Two daemon threads that end this process when the job cannot go on.

    The *watch* thread asks the job's store every ``tick`` seconds, over a connection of its
    own: whether a rank reported a failure (``abort``; this process then exits with
    :data:`EXIT_ABORTED`), and, with a ``heartbeat_timeout``, bumps this rank's counter
    ``hb/<rank>`` about every second and reads the next rank's (a ring: every rank is watched
    by exactly one other, so the store sees a few calls a second per rank). A counter that did
    not move for ``heartbeat_timeout`` seconds means that rank stopped running (``kill
    -STOP``, swapped out, a deadlock holding the GIL): the watchdog reports it under that
    rank's name, to the other ranks through ``abort`` and to shoal's launcher through the
    rank's failure file, and exits. A rank that is only slow (computing, sleeping, waiting in
    a collective) keeps beating: its main thread is not needed for that, only the GIL now
    and then. Collectives stay bounded by the process group's own timeout.

    The *guard* thread times the watch thread's store calls: a call to a host that stopped
    (rather than died) never returns, so one that is not back within ``heartbeat_timeout``
    means the store's host (shoal's launcher, the torchrun agent, or rank 0) stopped
    responding, and this process exits saying so.

    Both discount time in which this process itself did not run (a whole job stopped with
    Ctrl-Z and resumed): nobody can be judged over a time nobody was watching.
    """

    def __init__(self, comm: Comm, store: dist.Store, heartbeat_timeout: float | None) -> None:
        self._comm = comm
        self._rank, self._world = comm.rank, comm.world_size
        self._limit = heartbeat_timeout
        self._store = store
        if isinstance(store, dist.TCPStore):
            self._address = f"{store.host}:{store.port}"
        else:
            self._address = f"{comm.env.master_addr}:{comm.env.master_port}"
        self._tick = 0.5 if heartbeat_timeout is None else min(0.5, heartbeat_timeout / 6)
        # A longer gap than this between two looks means this process did not run meanwhile.
        self._gap = max(1.0, (heartbeat_timeout or 0.0) / 2)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call_since: float | None = None  # when the store call in flight began
        self._threads = [threading.Thread(target=self._watch, name="shoal-watchdog", daemon=True)]
        if heartbeat_timeout is not None:
            self._threads.append(threading.Thread(target=self._guard, name="shoal-store-guard",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float) -> None:
        """Stop both threads; wait up to ``timeout`` seconds for each."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout)

    # -- the watch thread --------------------------------------------------------------------
    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, timed by the guard thread."""
        with self._lock:
            self._call_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._call_since = None

    def _connect(self) -> dist.Store:
        """A store client of the watch thread's own, so that it never queues behind another."""
        store = self._store
        if isinstance(store, dist.TCPStore):
            store = dist.TCPStore(store.host, store.port, None, False,
                                  timeout=timedelta(seconds=30), wait_for_workers=False)
        return dist.PrefixStore(_key_prefix(), store)

    def _watch(self) -> None:
        _name_os_thread(f"shoal-hb-r{self._rank}")
        try:
            self._watch_store(self._call(self._connect))
        except Exception as exc:
            # The store is gone, and with it the job, unless we are shutting down normally.
            if not self._stop.wait(2.0):
                self._exit(self._lost_contact(f"{type(exc).__name__}: {first_line(exc, 200)}"))

    def _watch_store(self, store: dist.Store) -> None:
        limit = self._limit
        me, peer = f"hb/{self._rank}", f"hb/{(self._rank + 1) % self._world}"
        beat_every = 1.0 if limit is None else min(1.0, limit / 4)
        seen = -1  # the peer's count, and when it last changed by this process's clock
        seen_at = looked_at = next_beat = time.monotonic()
        while not self._stop.wait(self._tick):
            if self._call(store.check, [_ABORT_KEY]):
                reason = self._call(store.get, _ABORT_KEY).decode()
                if self._comm.aborted:
                    return  # this rank's own report, or one that crossed it: it is leaving
                self._exit(reason)
            if limit is None:
                continue
            if time.monotonic() < next_beat:
                continue
            self._call(store.add, me, 1)
            count = self._call(store.add, peer, 0)  # adding 0 reads it (and never waits)
            now = time.monotonic()
            next_beat = now + beat_every
            if count != seen or now - looked_at > self._gap:
                seen, seen_at = count, now
            elif now - seen_at > limit:
                self._hung(store, (self._rank + 1) % self._world)
            looked_at = now

    def _hung(self, store: dist.Store, rank: int) -> None:
        assert self._limit is not None
        message = f"{_HUNG}: no heartbeat for {self._limit:g} s (hung, stopped or swapped out)"
        reason = first = f"rank {rank}: {message}"
        with contextlib.suppress(Exception):
            # The first report stands: a rank that failed just before names the real cause.
            first = self._call(store.compare_set, _ABORT_KEY, "", reason).decode()
        if first != reason:
            self._exit(first)
        errdir = os.environ.get("SHOAL_ERROR_DIR")
        if errdir:
            with contextlib.suppress(OSError):
                _record_hung(errdir, rank, message, self._rank)
        self._exit(reason)

    # -- the guard thread --------------------------------------------------------------------
    def _guard(self) -> None:
        assert self._limit is not None
        last = time.monotonic()
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                if self._call_since is not None and now - last > self._gap:
                    self._call_since = now  # this process was not running: start again
                waited = 0.0 if self._call_since is None else now - self._call_since
            last = now
            if waited > self._limit:
                self._exit(self._lost_contact(f"no answer for {self._limit:g} s"))

    # -- leaving -----------------------------------------------------------------------------
    def _lost_contact(self, detail: str) -> str:
        host = {"local": "shoal's launcher", "torchrun": "the torchrun agent"}.get(
            self._comm.env.launcher, "rank 0")
        return f"lost contact with the job's store at {self._address} (served by {host}): {detail}"

    def _exit(self, reason: str) -> None:
        if "SHOAL_ERROR_DIR" not in os.environ:  # shoal's own launcher reports it
            print(f"shoal: rank {self._rank} stopping: {reason}", file=sys.stderr, flush=True)
        errfile = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if errfile:
            # torchrun's summary takes the first rank to exit for the root cause: this one
            # when it stops for another's failure. Its error file says whose it is.
            with contextlib.suppress(OSError), open(errfile, "w") as f:
                json.dump({"message": {"message": reason, "extraInfo": {
                    "py_callstack": f"rank {self._rank} stopped because {reason}",
                    "timestamp": str(int(time.time()))}}}, f)
        os._exit(EXIT_ABORTED)


def pick_device(device: str, local_rank: int) -> torch.device:
    """``cpu``, ``cuda`` (one GPU per local rank) or ``auto`` (cuda when available)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ShoalError("--device cuda, but torch sees no CUDA GPU")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ShoalError(f"local rank {local_rank} needs a GPU, but only {count} are visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    raise ShoalError(f"unknown device {device!r}; choose cpu, cuda or auto")


def init_comm(
    env: Environment,
    device: str = "auto",
    timeout_s: float = 300.0,
    threads: int | None = None,
    timeline: Timeline | None = None,
    heartbeat_timeout: float | None = 10.0,
) -> Comm:
    """Join the job described by ``env`` (``env://`` rendezvous) and return its :class:`Comm`.

    Gloo on CPU, NCCL on CUDA. ``timeout_s`` bounds every collective and the rendezvous, so
    a lost peer is an error, never a hang. ``heartbeat_timeout`` (seconds; ``None``: never)
    is how long a rank may send no heartbeat (stopped, swapped out) before the job stops and
    names it; a rank that only computes or waits keeps beating. ``threads`` sets this
    process's intra-op threads.
    """
    if heartbeat_timeout is not None and not (math.isfinite(heartbeat_timeout)
                                              and heartbeat_timeout > 0):
        raise ShoalError(f"heartbeat timeout must be a positive number of seconds (or None), "
                         f"got {heartbeat_timeout}")
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    dev = pick_device(device, env.local_rank)
    store = None
    if env.world_size > 1 and not dist.is_initialized():
        env.export()
        timeout = timedelta(seconds=timeout_s)
        try:
            store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
            dist.init_process_group(
                "nccl" if dev.type == "cuda" else "gloo",
                store=store,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
            )
        except (RuntimeError, ValueError) as exc:
            raise ShoalError(
                f"could not join the job at {env.master_addr}:{env.master_port} "
                f"as rank {env.rank} of {env.world_size}: {exc}"
            ) from exc
    return Comm(env, dev, timeline, store, heartbeat_timeout)
