"""Joining a job from a user's own script (the Fabric-style entry point)."""

from __future__ import annotations

from shoal.comm import Comm, init_comm
from shoal.config import default_threads
from shoal.launch import Environment, detect_environment

_COMM: Comm | None = None


def init(device: str = "auto", timeout_s: float = 300.0, threads: int | None = None) -> Comm:
    """Join the job this process was launched into and return its :class:`~shoal.comm.Comm`.

    Reads torchrun's, Slurm's or mpirun's environment; a process started on its own is a
    job of one. Calling it again returns the same ``Comm``. ``threads`` defaults to the
    machine's cores divided by the processes on this node.
    """
    global _COMM
    if _COMM is None:
        env = detect_environment() or Environment()
        if threads is None:
            threads = default_threads(env.local_world_size)
        _COMM = init_comm(env, device=device, timeout_s=timeout_s, threads=threads)
    return _COMM


def shutdown() -> None:
    """Leave the job joined by :func:`init` (waits for every rank first)."""
    global _COMM
    if _COMM is not None:
        _COMM.close()
        _COMM = None
