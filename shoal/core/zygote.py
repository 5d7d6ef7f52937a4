"""Imported first by the server that forks shoal's processes (:mod:`shoal.core.starting`),
and only there: from now on the server dies with the process that started it, whatever
kills that, so the processes it forks (each tied to the server) die with it too.

The server blocks SIGTERM (multiprocessing's makes it ignore SIGINT): a SIGTERM sent to the
whole job (Slurm's notice goes to every process of a step) asks each worker to checkpoint
and stop; the server's death would kill them all at once instead. A process it forks starts
with SIGTERM blocked and unblocks it first thing (:func:`shoal.core.starting.run_as_launched`):
a SIGTERM that came meanwhile then ends it, as it ends a process still importing.

Importing this module ties the importing process to its parent: never import it elsewhere.
"""

from __future__ import annotations

import os
import signal

from shoal.core.guard import die_with_parent

die_with_parent(os.getppid())
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
