"""``shoal train``, ``shoal run`` and ``shoal join`` start the server that forks their workers
before they import anything heavy, and do their work in a process forked from that server.

That server imports torch (and ``torch._dynamo`` for ``--compile``) once for every process
it forks (:mod:`shoal.core.starting`). The command's checks, its job's store and its records
need torch too: they run in a process the server forks first (:func:`run_forked`, named
``shoal launcher`` in ``ps`` and ``top``), which asks the same server for
the workers. The command's own process imports no torch at all: it passes signals on and
ends with the work's status. Only the command's own argument list is read to decide this,
before it is parsed: a guess about what the job needs (its number of workers, whether it
compiles), which the checks after it make right (a server already running keeps what it
imported; a process it forks imports the rest itself).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from shoal.core.descendants import adopt_orphans, end_descendants
from shoal.core.env import detect_environment
from shoal.core.guard import die_with, guarded_name, name_process, skip_exit_collection
from shoal.core.starting import (
    adopt_server,
    ensure_server,
    new_process,
    server_address,
    server_lost,
    server_modules,
    start_guarded,
    stop_server,
    stop_tracker,
    tracker_pid,
)
from shoal.errors import ShoalError

#: The commands that start processes here and do their work in a process forked from their
#: server, named :data:`LAUNCHER` there.
COMMANDS = ("train", "run", "join")
#: The name (in ``ps`` and ``top``) of the process that does such a command's work.
LAUNCHER = "shoal launcher"


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


def _run_flags(argv: Sequence[str]) -> list[str]:
    """``shoal run``'s own flags in ``argv`` (``run`` first): those before its script or
    module; everything after that is the script's."""
    flags, valued = [], ("--workers", "--threads-per-worker")
    rest = iter(argv[1:])
    for arg in rest:
        if not arg.startswith("-"):
            break
        flags.append(arg)
        if arg == "-m":
            break
        if arg in valued:
            flags.append(next(rest, ""))
    return flags


def wants_workers(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (a ``shoal`` command's arguments) looks like a command that starts
    processes here: ``shoal run`` (its ranks are processes, one included), ``shoal join``
    (its worker), or a ``shoal train`` with more than one worker (none given is one on a
    CPU), restarts, or a ``--config`` that may say so; not help, not a rank of an outside
    launcher."""
    if not argv or argv[0] not in COMMANDS:
        return False
    own = _run_flags(argv) if argv[0] == "run" else argv
    if "-h" in own or "--help" in own or _a_rank():
        return False
    if argv[0] in ("run", "join"):
        return True
    workers, restarts = _flag(argv, "--workers"), _flag(argv, "--max-restarts")
    return workers not in (None, "1") or restarts not in (None, "0") or \
        _flag(argv, "--config") is not None


def start_server_early(argv: Sequence[str]) -> bool:
    """Start the server that forks the workers of the ``shoal train`` in ``argv`` (torch's
    compiler front end too, for ``--compile``); whether it did."""
    if not wants_workers(argv):
        return False
    ensure_server(server_modules(compile="--compile" in argv, trains=argv[0] != "run"))
    return True


def runs_a_job(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a command that runs a job (``train``, ``run``, ``join``, here or
    as a rank of an outside launcher): its process adopts the orphans below it and ends
    them with the job (:func:`adopt_job_processes`, :func:`end_job_processes`)."""
    return bool(argv) and argv[0] in COMMANDS


def adopt_job_processes() -> None:
    """Before anything starts: every process the job starts, and every process those
    start (a user's script's, double-forked or not), stays below this one
    (:mod:`shoal.core.descendants`)."""
    adopt_orphans()


def quiet_native_warnings(argv: Sequence[str]) -> None:
    """Before torch is imported anywhere in the job: its C++ warnings (c10d's, each with a
    stack of native frames: a store connection reset as a job that failed ends) are left
    out of what the job prints, unless ``--debug`` or the user's own
    ``TORCH_CPP_LOG_LEVEL`` asks for them. shoal names what failed in its own lines."""
    if "--debug" not in argv:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def end_job_processes() -> None:
    """At the command's end, whatever ends it but SIGKILL: end every process still below
    this one (a user's script's children, the orphans it adopted), then multiprocessing's
    resource tracker (which ignores SIGTERM, and unlinks what was left registered)."""
    tracker = tracker_pid()
    end_descendants(spare=() if tracker is None else (tracker,))
    stop_tracker()


def _forked_command(argv: list[str], address: str, command: int) -> None:
    """The command ``argv``, in a process forked from the server at ``address``, whose
    workers that server forks too; exits with the command's status. It ends with the
    ``command``'s process, not with the server: a server lost is a failure it reports."""
    from shoal.cli import _main

    die_with(command)
    adopt_server(address)
    skip_exit_collection()
    name_process(LAUNCHER)
    sys.exit(_main(argv))


def _from_the_terminal() -> bool:
    """Whether a SIGINT here came from a terminal (Ctrl-C), which sends it to every process
    of its foreground group: this one's, that of the command's forked process too."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def run_forked(argv: list[str]) -> int | None:
    """Run the command ``argv`` in a process forked from this process's server (started by
    :func:`start_server_early`), which imported torch already: the command's checks, its
    store and its records there, this process (which imports no torch) passing SIGTERM and
    SIGINT on and ending with the same status (128 + N where a signal N ended it). ``None``
    where no server runs (``SHOAL_START_METHOD=spawn``, not Linux) or it could not fork."""
    address = server_address()
    if address is None:
        return None
    process = new_process(_forked_command, (list(argv), address, os.getpid()), daemon=False,
                          name=guarded_name("shoal", os.getpid()))

    def pass_on(signum: int, frame: object) -> None:
        if process.pid is not None and not (signum == signal.SIGINT and _from_the_terminal()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)

    before = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            start_guarded(process)
        except (OSError, EOFError):  # the server is gone: the work is done here instead
            return None
        process.join()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    code = process.exitcode
    lost = server_lost() if code != 0 else None
    if code < 0 and -code not in before:  # SIGKILL (the OOM killer's), SIGSEGV: no word left
        print(f"shoal: error: the command's process (pid {process.pid}) was killed by "
              f"{signal.Signals(-code).name}" + (f" ({lost})" if lost else ""), file=sys.stderr)
        stop_server()  # its workers end now, not after the import below
        _withdraw_job_file(argv)
    return code if code >= 0 else 128 - code


def _withdraw_job_file(argv: Sequence[str]) -> None:
    """The file a ``shoal join`` finds an elastic job by, which the command's process
    killed could not take away (``OUT`` as ``--out`` gives it)."""
    out = _flag(argv, "--out")
    if argv[:1] == ["train"] and "--elastic" in argv and out is not None:
        from shoal.train.membership.jobfile import withdraw

        withdraw(Path(out))


__all__ = ["COMMANDS", "LAUNCHER", "adopt_job_processes", "end_job_processes",
           "quiet_native_warnings", "run_forked", "runs_a_job", "start_server_early",
           "stop_server", "wants_workers"]
