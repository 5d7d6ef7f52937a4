"""How a rank's failure is reported, and how the launcher finds the one that started it.

Each failing rank writes ``rank<N>.json`` into the job's error folder (the launcher's
``Environment.error_dir``): its first line, type and traceback, and whether it is a root
cause or the echo of another rank's failure. :func:`root_cause` picks the one to report.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from typing import Any

from shoal.errors import ShoalError, WorkerError

#: Exit status of a rank that stopped because another rank failed (not a root cause).
EXIT_ABORTED = 75
#: How a rank that left the job before the others were done with it is reported.
LEFT_EARLY = "{how} while the others were still running"


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like the echo of another rank's failure (peer closed, timeout)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(
        s in text
        for s in ("connection closed", "connection reset", "gloo", "nccl", "broken pipe",
                  "socket", "timed out", "timeout")
    )


def first_line(exc: BaseException, limit: int = 400) -> str:
    """The first non-blank line of ``exc``'s message (its type's name if none), cut at ``limit``."""
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def record_failure(errdir: str, rank: int, exc: BaseException) -> None:
    """Write what went wrong on this rank where the supervising parent will read it."""
    echo = bool(getattr(exc, "echo", False))
    info = {
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": first_line(exc),
        # An error that says it is the echo of another process's failure (a parameter
        # server's pair that broke) is never the root cause, nor the user's to fix.
        "primary": not echo and (isinstance(exc, ShoalError) or not is_comm_failure(exc)),
        "user_error": isinstance(exc, ShoalError) and not echo and exc.user_error,
        # A ShoalError's message is written for the user: shown without its type's name.
        "plain": isinstance(exc, ShoalError),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    if info["primary"]:
        tmp = os.path.join(errdir, f".rank{rank}.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(errdir, f"rank{rank}.json"))
    else:  # an echo never replaces what another rank's watchdog found out about this one
        _write_new(errdir, rank, info, f".rank{rank}.tmp")


def exit_status(code: int) -> str:
    """``killed by signal 9`` or ``exited with code 3``: how a process ended."""
    return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


def read_errors(errdir: str) -> dict[int, dict[str, Any]]:
    found = {}
    for name in os.listdir(errdir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(errdir, name)) as f:
                info = json.load(f)
            found[info["rank"]] = info
    return found


def lost_connection(error: dict[str, Any]) -> bool:
    """Whether the failure report ``error`` says a connection closed under its rank."""
    text = error["message"].lower()
    return "connection closed" in text or "connection reset" in text


def root_cause(errdir: str, exits: dict[int, int],
               finished: dict[int, float] | None = None) -> WorkerError:
    """The failure that started it, from the error files and the exit codes of ranks that
    ended before shoal stopped the rest (their work undone): a real error first (or what a
    watchdog found out about a rank); then a rank that died without a word (killed, crashed);
    then one that exited with status 0 before its work was done, or whose work ended
    (``finished``: when, as ``time.time()``) before another rank lost a connection (a
    process group of the script's own, which nobody hangs up); only then the "peer closed
    the connection" echoes of them."""
    errors = read_errors(errdir)
    primary = sorted((e for e in errors.values() if e["primary"]), key=lambda e: e["time"])
    silent = sorted((code >= 0, rank) for rank, code in exits.items()
                    if rank not in errors and code not in (0, EXIT_ABORTED))
    if not primary and silent:
        rank = silent[0][1]
        return WorkerError(rank, f"worker process {exit_status(exits[rank])}",
                           exit_code=exits[rank])
    # A rank that ended with status 0 before its work was done (os._exit(0)): its peers'
    # errors ("connection reset by peer") are the echoes of its leaving.
    left = sorted(rank for rank, code in exits.items() if code == 0 and rank not in errors)
    cut_off = min((e["time"] for e in errors.values() if lost_connection(e)), default=None)
    left += sorted(rank for rank, at in (finished or {}).items()
                   if cut_off is not None and at <= cut_off and rank not in errors)
    if not primary and left:
        return WorkerError(left[0], LEFT_EARLY.format(how="exited with status 0"))
    echoes = sorted(errors.values(), key=lambda e: e["time"])
    if primary or echoes:
        err = (primary or echoes)[0]
        plain = err.get("plain", err["user_error"]) or not err["type"]
        message = err["message"] if plain else f"{err['type']}: {err['message']}"
        return WorkerError(err["rank"], message, err["traceback"], err["user_error"])
    rank = min(exits)
    return WorkerError(rank, f"worker process exited with code {exits[rank]}")


def record_for(errdir: str, rank: int, message: str, kind: str, why: str) -> None:
    """Write rank ``rank``'s failure report for shoal's launcher when another rank's watchdog
    found it out (it stopped, left or never came, and cannot write its own): the fields of
    :func:`record_failure`, as the root cause. ``kind`` prefixes the message (an exception
    type's name, or ``""``); ``why`` says how it was found out, in place of a traceback. A
    report the rank wrote itself is kept.
    """
    info = {"rank": rank, "time": time.time(), "type": kind, "message": message,
            "primary": True, "user_error": False, "traceback": f"(no traceback: {why})\n"}
    _write_new(errdir, rank, info, f".rank{rank}.by{os.getpid()}.tmp")


def _write_new(errdir: str, rank: int, info: dict[str, Any], tmp_name: str) -> None:
    """Write ``rank<N>.json`` unless there is one already (atomically either way)."""
    final = os.path.join(errdir, f"rank{rank}.json")
    tmp = os.path.join(errdir, tmp_name)
    try:
        with open(tmp, "w") as f:
            json.dump(info, f)
        try:
            os.link(tmp, final)  # atomic, and never over another report
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            if not os.path.exists(final):
                os.replace(tmp, final)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
