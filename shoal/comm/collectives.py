"""Process-group set-up and the timed collectives every strategy uses."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.errors import ShoalError
from shoal.processes import EXIT_ABORTED, Environment
from shoal.timeline import Timeline

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: Gloo has no AVG
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}

_ABORT_KEY = "abort"


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
    strategies need no special case for a single process.
    """

    def __init__(
        self,
        env: Environment,
        device: torch.device,
        timeline: Timeline | None = None,
        store: dist.Store | None = None,
    ) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.device = device
        self.timeline = timeline or Timeline()
        self.bytes_sent = 0  # payload handed to collectives by this rank during training
        self.calls = 0
        self._store = dist.PrefixStore("shoal/", store) if store is not None else None
        self._stop = threading.Event()
        self.aborted = False  # this rank called abort(): nobody will wait for it at close()
        self._watchdog: threading.Thread | None = None
        if self._store is not None and self.world_size > 1:
            self._watchdog = threading.Thread(target=self._watch, name="shoal-abort", daemon=True)
            self._watchdog.start()

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
        """Tell every other rank that this one failed, so they exit instead of waiting."""
        self.aborted = True
        if self._store is not None:
            try:
                first = (message.strip().splitlines() or ["failed"])[0][:300]
                self._store.set(_ABORT_KEY, f"rank {self.rank}: {first}")
            except Exception:  # the store may be gone already; the launcher still reaps us
                pass

    def _watch(self) -> None:
        assert self._store is not None
        while not self._stop.wait(0.5):
            try:
                failed = self._store.check([_ABORT_KEY])
                reason = self._store.get(_ABORT_KEY).decode() if failed else ""
            except Exception:
                # The store lives on rank 0 (or the launcher): if it is gone, so is the job,
                # unless we are shutting down normally.
                if self._stop.wait(2.0):
                    return
                reason = "lost contact with the job's rendezvous store"
            if reason:
                if reason.startswith(f"rank {self.rank}:"):
                    return
                if "SHOAL_ERROR_DIR" not in os.environ:  # shoal's own launcher reports it
                    print(f"shoal: rank {self.rank} stopping: {reason}", file=sys.stderr,
                          flush=True)
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
            self._stop.set()
            if self._watchdog is not None:
                self._watchdog.join(timeout=5.0)
            try:
                if finished and self.active:
                    # Rank 0 hosts the store: it must not exit while another rank's watchdog
                    # may still be asking it. A store call cut off while the interpreter
                    # shuts down ends the process in std::terminate (signal 6).
                    dist.barrier()
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()


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
) -> Comm:
    """Join the job described by ``env`` (``env://`` rendezvous) and return its :class:`Comm`.

    Gloo on CPU, NCCL on CUDA. ``timeout_s`` bounds every collective and the rendezvous, so
    a lost peer is an error, never a hang. ``threads`` sets this process's intra-op threads.
    """
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
    return Comm(env, dev, timeline, store)
