"""``shoal.fork``: start a parallel session whose workers run
:func:`shoal.parallel.worker.worker_main`, and make it the one calls use."""

from __future__ import annotations

import os

from shoal.errors import ShoalError
from shoal.parallel.context import in_function
from shoal.parallel.session import ParallelSession, current, make_current
from shoal.parallel.worker import worker_main


def fork(n: int, device: str = "cpu", *, timeout: float = 600.0, threads: int | None = None,
         trace: str | os.PathLike[str] | None = None) -> ParallelSession:
    """Start a parallel session of ``n`` processes: ``n - 1`` workers, and this process as
    rank 0, which computes its share too.

    Calls of `shoal.function` functions and the collectives then run on all ``n``. Use it
    as a context manager, or end it with `shoal.close`. Workers never run the main program
    (a script needs no ``if __name__ == "__main__":`` guard; stdin, ``-c`` and a REPL work):
    functions reach them by value. A worker that dies ends the call it is in at once; the
    session is then broken: later calls raise until ``fork`` is called again (or
    `shoal.close`). The session listens on loopback only.

    Args:
        n: The number of processes, this one included (1: calls run here alone).
        device: ``"cpu"`` (Gloo) or ``"cuda"`` (rank r on GPU r; NCCL for tensors).
        timeout: Seconds that bound every wait in the session, a call waiting for the
            slowest worker included.
        threads: Each process's torch threads; default the cores divided by ``n``.
        trace: A path; when the session closes, every rank's time in calls (arguments,
            compute, communication) is written there as one Chrome trace, one lane per
            rank.

    Returns:
        The session, now the current one (a context manager that closes it).

    Raises:
        ShoalError: Called inside a parallel function or while a session is open, an
            ``n`` below 1 or more processes than the machine holds, an unknown device or
            too few GPUs, a process that already has a ``torch.distributed`` group, or a
            ``trace`` whose directory does not exist.
        WorkerError: A worker died while the session started, or did not start within
            ``timeout`` (at least a minute).
    """
    if in_function():
        raise ShoalError("shoal.fork cannot be called inside a parallel function")
    if current() is not None:
        raise ShoalError("a parallel session is already open; call shoal.close() first")
    return make_current(ParallelSession(n, device, timeout, threads, worker_main=worker_main, trace=trace))
