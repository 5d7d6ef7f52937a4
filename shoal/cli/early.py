"""``shoal train`` starts the server that forks its workers before it imports anything heavy.

That server imports torch (and ``torch._dynamo`` for ``--compile``) once for every worker
it forks (:mod:`shoal.core.starting`); the command itself imports torch too, to check the
model and the data. Started first, the two imports run side by side on two cores instead
of one after the other: about 2 s less before a small job's first step. Only the command's
own argument list is read here, before it is parsed: a guess about what the job needs (its
number of workers, whether it compiles), which the checks after it make right (a server
already running keeps what it imported; a process it forks imports the rest itself).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from shoal.core.env import detect_environment
from shoal.core.starting import ensure_server, stop_server
from shoal.errors import ShoalError


def _a_rank() -> bool:
    """Whether an outside launcher (torchrun, srun, mpirun) made this process one of its
    ranks, as ``shoal train`` itself tells (:func:`~shoal.core.env.detect_environment`, from
    the variables alone): such a process trains in itself and forks nothing. Variables of a
    launcher that ``shoal train`` will refuse count as one: its one line comes soon after."""
    try:
        return detect_environment(os.environ) is not None
    except ShoalError:
        return True


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The last value given to ``name`` (``--name V`` or ``--name=V``), or ``None``."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.partition("=")[2]
    return value


def wants_workers(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (a ``shoal`` command's arguments) looks like a ``shoal train`` that
    starts processes here: more than one worker (none given is one on a CPU), restarts, or a
    ``--config`` that may say so; not help, not a rank of an outside launcher."""
    if not argv or argv[0] != "train" or "-h" in argv or "--help" in argv:
        return False
    if _a_rank():
        return False
    workers, restarts = _flag(argv, "--workers"), _flag(argv, "--max-restarts")
    return workers not in (None, "1") or restarts not in (None, "0") or \
        _flag(argv, "--config") is not None


def start_server_early(argv: Sequence[str]) -> bool:
    """Start the server that forks the workers of the ``shoal train`` in ``argv`` (torch's
    compiler front end too, for ``--compile``); whether it did."""
    if not wants_workers(argv):
        return False
    ensure_server(["torch._dynamo"] if "--compile" in argv else [])
    return True


__all__ = ["start_server_early", "stop_server", "wants_workers"]
