"""A parallel session's collectives through its host's shared memory.

Every rank of a session (the controller, rank 0, and its workers, all on this host) joins
the host's path once, right after the session's process group
(:func:`shoal.core.hostpath.join_host`: one segment, owner-only, unlinked once mapped). From
then on the collectives of CPU tensors inside a parallel function go through it at memory
speed: ``shoal.all_reduce`` and ``shoal.reduce`` (``sum``, ``avg``) sum in rank order;
``shoal.broadcast``, ``shoal.gather``, ``shoal.all_gather`` and ``shoal.scatter`` copy
bytes (every dtype). Sums the path does not take (GPU tensors, ``max``, ``min``,
``prod``) go through Gloo. A session on GPUs, or on a host without the path, is Gloo's
throughout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shoal.core.hostpath import join_host
from shoal.core.intrahost import HostPath, SharedReducer

_PATH: list[HostPath] = []  # the session's path, where it has one


class _SessionGroup:
    """The session's process group (the default one), as :func:`join_host` reads a group."""

    def __init__(self, device: torch.device) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = device

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def join(device: str, timeout: float) -> None:
    """Take the host's path for this session's sums (every rank, right after joining the
    session's group: a collective), unless its device is a GPU.

    Args:
        device: The session's device (``cpu`` or ``cuda``).
        timeout: Seconds a rank waits for the others inside a sum.
    """
    _PATH.clear()
    if device != "cpu":
        return
    reducer = join_host(_SessionGroup(torch.device("cpu")), "auto", timeout=timeout)
    if reducer is not None:
        _PATH.append(HostPath(reducer))


def leave() -> None:
    """The session is over: its sums' path goes."""
    _PATH.clear()


def host_path() -> HostPath | None:
    """The running session's path through the host's memory, or ``None`` (Gloo)."""
    return _PATH[0] if _PATH else None


def copier(tensors: list[torch.Tensor]) -> SharedReducer | None:
    """What moves ``tensors`` of a broadcast, gather or scatter among the session's ranks:
    its host's memory where the session has that path and they are CPU tensors, else
    ``None`` (Gloo)."""
    path = host_path()
    if path is None or any(t.device.type != "cpu" for t in tensors):
        return None
    return path.one_host()
