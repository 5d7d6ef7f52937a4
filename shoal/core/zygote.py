"""Imported first by the server that forks shoal's processes (:mod:`shoal.core.starting`),
and only there.

The server blocks SIGTERM (multiprocessing's makes it ignore SIGINT): a SIGTERM sent to the
whole job (Slurm's notice goes to every process of a step) asks each worker to checkpoint
and stop; the server's death would kill them all at once instead. A process it forks starts
with SIGTERM blocked and unblocks it first thing (:func:`shoal.core.starting.run_as_launched`):
a SIGTERM that came meanwhile then ends it, as it ends a process still importing.

The server ends when the process that started it does, however that dies: multiprocessing's
server exits once its end of a pipe only that process holds reads end-of-file (at once if
that process died while the server was still importing), and each process it forked is
tied to it (:func:`shoal.core.guard.guard_child`). It asks for no death signal of its own:
Linux sends that when the *thread* that started it ends, and the thread that starts a
process's first worker need not live as long as the process.
"""

from __future__ import annotations

import atexit
import os
import signal

from shoal.core.guard import name_process

#: The server's own pid: the processes it forks inherit the exit handler below.
SERVER_PID = os.getpid()


def _leave_at_once() -> None:
    """The server's last exit handler: it leaves without tearing down its interpreter (torch's
    modules: about 0.8 s of CPU, seconds on a loaded machine, while a job that lost its
    launcher waits for its processes to go). A process it forked does not leave here."""
    if os.getpid() == SERVER_PID:
        os._exit(0)


signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
atexit.register(_leave_at_once)  # first registered, last run
name_process("shoal forkserver")
