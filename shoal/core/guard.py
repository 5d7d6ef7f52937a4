"""No process shoal starts outlives the process that started it, whatever kills that and when.

Linux's ``PR_SET_PDEATHSIG`` sends a child SIGKILL when its parent dies, but only from the
moment the child asks for it: a parent that died before then has left the child with a new
parent (init or a subreaper) that never dies. So every child runs :func:`die_with_parent`
(PDEATHSIG, then "is my parent still the one that started me?") as the first thing it
does, and this module imports nothing but the standard library, so that first thing comes
within milliseconds of the child's start, not after seconds of importing torch:

- processes of :func:`shoal.core.processes.start_process` (multiprocessing's "spawn") run
  this file as their ``__mp_main__``, before they unpickle (and import) their target; the
  launcher's pid travels in the process name (:func:`guarded_name`), which multiprocessing
  sets before it runs the main module (about 30 ms after the start, measured);
- commands run through :func:`guarded_command` start as ``python guard.py PID -- CMD...``,
  which guards itself and then ``exec``s ``CMD`` (PDEATHSIG survives ``exec``; the pid
  stays the same).

What a process leaves outside processes (the emulated cluster's namespaces and cgroups) is
cleaned up by :func:`after_death`: a watcher that waits, doing nothing, for its parent's
death, whatever kills it, and only then runs the cleanup command.

SIGKILL, not SIGTERM: a training worker takes SIGTERM as "checkpoint and stop", which needs
its launcher and its peers, and an orphan has neither.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import multiprocessing
import os
import re
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
_NAME = re.compile(r" \[launcher (\d+)\]$")


def prctl(option: int, value: int | bytes) -> None:
    """Linux's ``prctl(option, value)`` for this process (its calling thread); nothing
    elsewhere, nor where the C library cannot be reached."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(option, value)


def name_thread(name: str) -> None:
    """Name the calling thread (at most 15 bytes) where ``ps -L``, ``top -H`` and
    ``/proc/PID/task`` show it; the main thread's name is the process's in ``ps``."""
    prctl(PR_SET_NAME, name.encode()[:15])


def name_process(title: str) -> None:
    """Name this process ``title`` (``shoal worker 2``, ``shoal server 0``) where ``ps``
    (its command line) and ``top`` (its name, 15 bytes: ``worker 12345`` where
    ``shoal worker 12345`` would be cut) show it; from the main thread, whose name is the
    process's. The title gets the room of the command line the process started with
    (every shoal process's is longer), so that ``/proc/PID/environ`` keeps the environment
    (``setproctitle``'s ``SPT_NOENV``): the tests find their processes there."""
    import setproctitle  # not at the top: a guarded child's first code is standard only

    ours = "SPT_NOENV" not in os.environ
    os.environ["SPT_NOENV"] = "1"  # read once, at the first title
    try:
        setproctitle.setproctitle(title)
    finally:
        if ours:
            del os.environ["SPT_NOENV"]
    name_thread(title if len(title) <= 15 else title.removeprefix("shoal "))


def show_threads_on_usr1() -> None:
    """``kill -USR1`` prints where each of this process's threads is (Python's
    ``faulthandler``), unless something here takes SIGUSR1 already."""
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        import faulthandler  # not at the top: a guarded child's first code is small

        faulthandler.register(signal.SIGUSR1, all_threads=True)


def die_with_parent(parent: int) -> None:
    """End this process now unless its parent is ``parent`` (the pid that started it), and
    have Linux end it when that parent dies from now on."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # After the prctl: a parent that dies from here on is covered by it, one that died
    # before shows as a different parent now.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with(pid: int) -> None:
    """End this process when process ``pid`` ends (at once if it has), instead of with its
    parent: a watcher thread holds a pidfd of ``pid``. For a process whose parent may be lost
    while the job goes on (``shoal``'s work process, forked from the command's server: the
    command, a child subreaper, adopts it then)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already (or no pidfds: keep the parent's death signal)
        if not os.path.exists(f"/proc/{pid}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return
    prctl(PR_SET_PDEATHSIG, 0)
    threading.Thread(target=_kill_when_ready, args=(fd,), name="shoal-guard", daemon=True).start()


def _kill_when_ready(fd: int) -> None:
    select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """For a rank an outside launcher (torchrun, srun, mpirun) started, as its first act:
    end with that launcher, whatever kills it. A launcher killed with SIGKILL cannot end its
    ranks, and under mpirun nothing else would: rank 0 serves the job's store, so the ranks
    trained on as orphans. (A rank started by a shell the launcher started is the shell's.)"""
    parent = os.getppid()
    if parent != 1:  # already init's: started by something that detached it on purpose
        die_with_parent(parent)


def skip_exit_collection() -> None:
    """Spare this process Python's last garbage collection at exit, which walks every object
    torch made (about 1 s of CPU per process, every job's end): :func:`gc.freeze` in an
    exit handler (they all run before it) puts them out of its reach. Only for shoal's own processes (the
    launcher, ranks, servers): the collection would run ``__del__`` of objects in cycles,
    which no code of shoal leaves work to."""
    atexit.register(gc.freeze)  # every exit handler runs before that collection


def guarded_name(name: str | None, parent: int) -> str:
    """The multiprocessing name that tells a child started by ``parent`` whom to watch."""
    return f"{name or 'shoal'} [launcher {parent}]"


def title_of(name: str) -> str:
    """The process title a :func:`guarded_name` gives (``shoal-join-3`` -> ``shoal join 3``)."""
    return _NAME.sub("", name).replace("-", " ")


def launcher_of(name: str) -> int | None:
    """The launcher's pid a :func:`guarded_name` holds; ``None`` for any other name."""
    m = _NAME.search(name)
    return int(m.group(1)) if m else None


def guarded_command(cmd: list[str]) -> list[str]:
    """``cmd`` (a program and its arguments) as a command that dies with this process: run
    through this file, which guards itself, then becomes ``cmd`` (same pid)."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), "--", *cmd]


def after_death(cmd: list[str]) -> list[str]:
    """A command that waits for this process to die (however: SIGKILL included), then runs
    ``cmd`` and exits; start it in a session of its own so a kill of this process's group
    spares it. Stopping it with SIGKILL before this process dies runs nothing."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), "--after", str(os.getpid()),
            "--", *cmd]


def _exec_after(argv: list[str]) -> None:
    """``guard.py --after PARENT -- CMD...``: wait for ``PARENT`` to die, become ``CMD``."""
    parent = int(argv[0])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by sigtimedwait
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    while os.getppid() == parent:  # a parent that died before the prctl shows here
        signal.sigtimedwait({signal.SIGTERM}, 5.0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.execvp(argv[2], argv[2:])


def _exec_guarded(argv: list[str]) -> None:
    """``guard.py PARENT -- CMD...``: guard this process against ``PARENT``, become ``CMD``."""
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit("usage: guard.py PARENT_PID -- COMMAND [ARGS...]")
    die_with_parent(int(argv[0]))
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as exc:
        sys.exit(f"shoal: error: cannot run {argv[2]}: {exc.strerror}")


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux's ``/proc``); ``None`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def guard_child(launcher: int) -> None:
    """For a child of ``start_process``: die with its parent, which is ``launcher`` itself,
    the server ``launcher`` started to fork its processes (which ends with the launcher:
    :mod:`shoal.core.zygote`), or the server ``launcher`` was itself forked from (``shoal
    train``'s, which ends with the command, as does ``launcher``: :mod:`shoal.cli.early`);
    at once when it is none of them."""
    parent = os.getppid()
    its_server = parent_of(parent) == launcher
    same_server = parent != 1 and parent_of(launcher) == parent
    if parent != launcher and (its_server or same_server):
        die_with_parent(parent)
    else:
        die_with_parent(launcher)


if __name__ == "__mp_main__":  # a child of start_process, before its target is unpickled
    _launcher = launcher_of(multiprocessing.current_process().name)
    if _launcher is not None:
        guard_child(_launcher)
elif __name__ == "__main__" and sys.argv[1:2] == ["--after"] and sys.argv[4:5] \
        and sys.argv[2].isdigit() and sys.argv[3] == "--":
    _exec_after(sys.argv[2:])
elif __name__ == "__main__":
    _exec_guarded(sys.argv[1:])
