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
    """Start ``n - 1`` workers; this process is rank 0 and computes its share too.

    ``device``: ``cpu`` (Gloo) or ``cuda`` (rank r on GPU r; NCCL for tensors). ``timeout``
    bounds every wait in the session, including a call waiting for the slowest worker.
    ``threads`` sets each process's torch threads (default: cores divided by ``n``).
    ``trace``: a path; when the session closes, every rank's time in calls (arguments,
    compute, communication) is written there as one Chrome trace, one lane per rank. Use it
    as a context manager, or end it with :func:`close`. Workers never run the main program
    (a script needs no ``if __name__ == "__main__":`` guard; stdin, ``-c`` and a REPL work):
    functions reach them by value. A worker that dies ends the call it is in at once; the
    session is then broken: later calls raise until ``fork`` is called again (or
    :func:`close`). The session listens on loopback only.
    """
    if in_function():
        raise ShoalError("shoal.fork cannot be called inside a parallel function")
    if current() is not None:
        raise ShoalError("a parallel session is already open; call shoal.close() first")
    return make_current(ParallelSession(n, device, timeout, threads, worker_main=worker_main, trace=trace))
