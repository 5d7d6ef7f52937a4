"""Which path a job's sums take among the processes of one host, and taking it.

``--intra-host auto`` (the default) sums through the host's shared memory
(:class:`~shoal.core.intrahost.SharedReducer`) where the whole job is on one host and can
(Linux's ``/dev/shm``, x86-64, CPU tensors, a fixed group); else Gloo. A job that the host
keeps off the fast path says why in one line; one that takes Gloo by design (across hosts,
``--elastic``, on GPUs) says nothing. ``shm`` insists (an error where it cannot), ``gloo``
never tries.

:func:`use_host_memory` puts the path on a :class:`~shoal.core.comm.Comm`: from then on its
sums and averages of CPU tensors (the periodic strategies' exchanges, a strategy's metrics)
go through the host's memory, each one done when it returns, and DDP's buckets through
:func:`~shoal.strategies.sync_hooks.shared_memory_hook`.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from shoal.core.intrahost import (
    SLOT_BYTES,
    HostPath,
    HostsReducer,
    SharedReducer,
    Summing,
    segment_bytes,
)
from shoal.core.segment import (
    SHM_DIR,
    create_segment,
    host_key,
    open_segment,
    pid_space,
    segment_name,
    sweep_stale,
    unavailable_here,
    unlink_segment,
)
from shoal.errors import ShoalError

if TYPE_CHECKING:
    import torch

    from shoal.core.comm import Comm

log = logging.getLogger("shoal.intrahost")
SPANS = "the job spans"  # the one reason told at DEBUG only: one process a host

class Ranks(Protocol):
    """What :func:`join_host` needs of a group of ranks: a job's
    :class:`~shoal.core.comm.Comm`, or a parallel session's group."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def active(self) -> bool:
        """Whether there are other ranks to talk to."""

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """``obj`` of every rank, at ``dst`` (``None`` elsewhere)."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank."""


#: ``--intra-host``: pick the fast path where it serves, Gloo always, or the fast path or fail.
MODES = ("auto", "gloo", "shm")
#: ``--intra-host``'s help, the same for every strategy that takes it.
HELP = ("how the processes of one host talk: gloo, shm (shared memory; sums across hosts go "
        "host by host with one leader a host on the link) or auto (sums: shm where the job "
        "runs on CPUs, is not --elastic and has several processes on a host, else gloo, "
        "saying why if the host is the reason; a parameter server and a worker: shm where "
        "they share a host)")

def check_mode(mode: str) -> None:
    """``--intra-host``'s value: one of :data:`MODES`.

    Raises:
        ShoalError: Any other, in one line.
    """
    if mode not in MODES:
        raise ShoalError(f"--intra-host must be one of {', '.join(MODES)}, got {mode!r}")


def use_host_memory(comm: Comm, mode: str) -> Summing | None:
    """Put ``--intra-host mode``'s path on ``comm`` (:attr:`Comm.host`) and return its
    reducer, or ``None`` for Gloo. A collective of every rank the first time it tries the
    fast path; later calls keep what the first found (``gloo`` turns it off).

    Args:
        comm: The job's Comm.
        mode: ``auto``, ``gloo`` or ``shm``.

    Returns:
        The reducer, or ``None``: Gloo.

    Raises:
        ShoalError: ``mode`` is ``shm`` and the fast path is not available.
    """
    check_mode(mode)
    if mode == "gloo" or not comm.active:
        comm.host = None
        return None
    if comm.membership is not None:
        if mode == "shm":
            raise ShoalError("--intra-host shm: --elastic re-forms the group, which the "
                             "shared-memory path does not follow")
        return None  # an elastic job's path is Gloo's by design: nothing to tell
    if comm.device.type != "cpu":
        return None  # GPUs: NCCL's
    if comm not in _FOUND:
        _FOUND[comm] = join_host(comm, mode)
    reducer = _FOUND[comm]
    if reducer is None and mode == "shm":
        raise ShoalError("--intra-host shm: the fast path was not available to this job")
    comm.host = HostPath(reducer) if reducer is not None else None
    return reducer


#: What the first try found, by Comm: a later strategy of the job (a planning session's
#: next trial) takes it again without a collective.
_FOUND: weakref.WeakKeyDictionary[Comm, Summing | None] = weakref.WeakKeyDictionary()


def join_host(comm: Ranks, mode: str, *, slot_bytes: int = SLOT_BYTES,
              timeout: float = 300.0) -> Summing | None:
    """The job's sums through its hosts' shared memory for ``--intra-host mode``, or
    ``None``: Gloo.

    On one host, one segment for the job. Across hosts with several processes on some, one
    segment a host and a Gloo group of one leader a host (:class:`HostsReducer`): the slow
    link carries one process's bytes a host, not every process's. A collective of every
    rank of ``comm``'s job (unless ``mode`` is ``gloo`` or the job has one rank). With
    ``auto``, a job that cannot take the fast path goes on with Gloo and rank 0 says why in
    one line (at DEBUG where that is by design: one process a host); with ``shm`` that is
    an error.

    Args:
        comm: The job's Comm, or a parallel session's ranks (:class:`Ranks`: its object
            collectives carry the segments' names).
        mode: ``auto``, ``gloo`` or ``shm``.
        slot_bytes: The largest chunk summed at once (a multiple of 64).
        timeout: Seconds a rank waits for the others inside an all-reduce.

    Returns:
        The reducer, or ``None`` for Gloo.

    Raises:
        ShoalError: ``mode`` is ``shm`` and the fast path is not available.
    """
    check_mode(mode)
    if mode == "gloo" or not comm.active:
        return None
    reducer = None
    why, hosts = _layout(comm)
    if why is None:
        reducer, why = attach_hosts(comm, hosts, slot_bytes, timeout)
    if why is None:
        return reducer
    if mode == "shm":
        raise ShoalError(f"--intra-host shm: {why}")
    if comm.rank == 0:  # one process a host takes Gloo by design: nothing wrong to tell
        log.log(logging.DEBUG if why.startswith(SPANS) else logging.WARNING,
                f"shoal: the job's sums go through Gloo: {why}")
    return None


def _layout(comm: Ranks) -> tuple[str | None, list[list[int]]]:
    """Rank 0's verdict, the same on every rank: why the job cannot take the fast path, or
    its ranks by host (in the order of their first rank)."""
    seen = comm.gather_objects((host_key(), unavailable_here(comm.device.type)))
    verdict: tuple[str | None, list[list[int]]] = (None, [])
    if seen is not None:
        by_host: dict[str, list[int]] = {}
        for rank, (key, _) in enumerate(seen):
            by_host.setdefault(key, []).append(rank)
        hosts = list(by_host.values())
        local = [(rank, reason) for rank, (_, reason) in enumerate(seen) if reason]
        if local:
            verdict = (f"rank {local[0][0]}: {local[0][1]}", [])
        elif len(hosts) > 1 and all(len(h) == 1 for h in hosts):
            verdict = (f"{SPANS} {len(hosts)} hosts, one process each", [])
        else:
            verdict = (None, hosts)
    return comm.broadcast_object(verdict)


def attach_hosts(comm: Ranks, hosts: list[list[int]], slot_bytes: int,
            timeout: float) -> tuple[Summing | None, str | None]:
    """Each host's first rank creates its segment, every rank maps its host's, the creators
    unlink them: the reducer, or why not (the same on every rank). Across hosts, every
    rank joins the leaders' group (a collective of the job)."""
    mine = next(h for h in hosts if comm.rank in h)
    lead, size = mine[0], segment_bytes(len(mine), slot_bytes)
    name, segment, error = None, None, None
    try:
        if comm.rank == lead and len(mine) > 1:  # alone on its host: no segment
            sweep_stale()
            try:
                name = segment_name()
                segment = create_segment(name, size)
            except OSError as exc:
                name, error = None, f"could not create a segment in {SHM_DIR}: {exc}"
        seen = comm.broadcast_object(comm.gather_objects((name, os.getpid(), pid_space())))
        names = [n for n, _, _ in seen]
        # Each rank's process, watched by the others of its host (a rank that died inside a
        # sum is named at once), where all of them number processes alike.
        pids = [p for _, p, _ in seen] if len({seen[r][2] for r in mine}) == 1 else None
        if comm.rank != lead and names[lead] is not None:
            try:
                segment = open_segment(names[lead], size)
            except (OSError, ValueError) as exc:
                error = f"rank {comm.rank} could not map the segment: {exc}"
        errors = comm.gather_objects(error)
    finally:
        if comm.rank == lead and name is not None:
            unlink_segment(name)  # mapped by its host (or failed): nothing left behind
    why = comm.broadcast_object(next((e for e in errors or [] if e), None))
    if why is not None or (segment is None and len(mine) > 1):
        if segment is not None:
            segment.close()
        return None, why or "no segment"
    local = None if segment is None else SharedReducer(
        segment, mine.index(comm.rank), len(mine), slot_bytes=slot_bytes, timeout=timeout,
        pids=None if pids is None else [pids[r] for r in mine])
    if len(hosts) == 1:
        return local, None
    leaders = dist.new_group([h[0] for h in hosts], backend="gloo")  # every rank: a collective
    return HostsReducer(local, leaders if comm.rank == lead else None, comm.world_size), None
