"""Nothing a job started outlives it, a user's own processes included: the command's process
adopts every orphan below it and ends what is left of them when the job ends.

A process a user's script or dataset starts (``subprocess.Popen``, a double fork with
``setsid``) has no tie to shoal's launcher: when the rank that started it exits, Linux gives
it to init, and it runs on after the job. So the process of a ``shoal`` command that runs a
job (``train``, ``run``, ``join``) first makes itself a *child subreaper*
(``PR_SET_CHILD_SUBREAPER``, :func:`adopt_orphans`): an orphan of any process below it then
becomes its child instead of init's. When the job ends (success, an error, SIGTERM, Ctrl-C)
:func:`end_descendants` ends every process still below it (SIGTERM, a short grace, SIGKILL),
found through the parent links of ``/proc/*/stat``, and reaps them. Only this process's own
descendants are ever signalled, each through a pidfd opened while it was known to be one
(a pid reused meanwhile is never hit).

Standard library only: the command's process imports no torch (:mod:`shoal.cli.early`).
A command killed with SIGKILL cannot do this; what it tied to itself ends all the same
(:mod:`shoal.core.guard`), a user's detached processes do not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Collection

from shoal.core.guard import prctl

PR_SET_CHILD_SUBREAPER = 36
#: Seconds the processes left at a job's end get to go after SIGTERM, before SIGKILL.
GRACE_S = 1.0


def adopt_orphans() -> None:
    """Make this process the parent of every orphan below it (Linux; nothing elsewhere):
    a process whose parent dies is given to this one, not to init, so that
    :func:`end_descendants` finds it."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def _stat(pid: int) -> tuple[int, str] | None:
    """Process ``pid``'s parent and state letter (``Z``: ended, not yet reaped), or
    ``None`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        return int(fields[1]), fields[0].decode()
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """The live processes below ``root`` (children first, then theirs), from ``/proc``'s
    parent links (an ended child not yet reaped is left out); empty where there is no
    ``/proc``."""
    below: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            stat = _stat(int(name)) if name.isdigit() else None
            if stat is not None and stat[1] != "Z":
                below.setdefault(stat[0], []).append(int(name))
    found, queue = [], [root]
    while queue:
        children = below.get(queue.pop(0), [])
        found += children
        queue += children
    return found


def _signal_all(sig: int, spare: Collection[int]) -> int:
    """Send ``sig`` to every descendant of this process but ``spare``; how many got it."""
    me, sent = os.getpid(), 0
    for pid in descendants(me):
        if pid in spare:
            continue
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already
            continue
        try:
            # Still below this process once the pidfd holds it: the pid cannot be reused now.
            if pid in descendants(me):
                signal.pidfd_send_signal(fd, sig)
                if sig == signal.SIGTERM:  # a stopped process holds SIGTERM until it runs
                    signal.pidfd_send_signal(fd, signal.SIGCONT)
                sent += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return sent


def reap(spare: Collection[int] = ()) -> None:
    """Collect the exit status of every ended child of this process but ``spare`` (those
    a caller waits for itself): the orphans it adopted."""
    me = os.getpid()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            stat = _stat(int(name)) if name.isdigit() else None
            if stat is not None and stat == (me, "Z") and int(name) not in spare:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(int(name), os.WNOHANG)


def _left(spare: Collection[int]) -> list[int]:
    return [pid for pid in descendants(os.getpid()) if pid not in spare]


def _wait_gone(spare: Collection[int], timeout: float) -> bool:
    """Reap the adopted orphans as they end, for up to ``timeout`` seconds; whether every
    descendant but ``spare`` is gone."""
    deadline = time.monotonic() + timeout
    while True:
        reap(spare)
        if not _left(spare):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def end_descendants(spare: Collection[int] = (), grace: float = GRACE_S) -> list[int]:
    """End every process still below this one but ``spare`` (SIGTERM, up to ``grace``
    seconds, then SIGKILL) and reap those it adopted. Returns the pids that had to be
    ended (none when the job left nothing behind).

    Args:
        spare: processes left alone (a caller's own, which it ends and waits for itself).
        grace: seconds between SIGTERM and SIGKILL.
    """
    left = _left(spare)
    if left and _signal_all(signal.SIGTERM, spare) and not _wait_gone(spare, grace):
        _signal_all(signal.SIGKILL, spare)
        _wait_gone(spare, 5.0)
    reap(spare)
    return left


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's included).

    Args:
        pid: The process id.

    Returns:
        ``False`` only when no process has that id.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["adopt_orphans", "descendants", "end_descendants", "pid_alive", "reap"]
