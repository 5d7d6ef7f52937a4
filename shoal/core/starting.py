"""How shoal starts its local processes: forked from a server that imported torch once.

Every worker of a job used to start as a fresh interpreter ("spawn") that imported torch
(about 1.2 s of CPU), and torch's compiler front end as well under DDP (1 s more): on a
small job most of the CPU it spent. On Linux shoal now starts them with multiprocessing's
"forkserver": a server process, started by this process the first time it starts one, that
imports torch and ``torch.distributed`` once (before any thread, any CUDA call; and
``torch._dynamo`` for a job that compiles) and forks each process from there.
``SHOAL_START_METHOD=spawn`` goes back to fresh interpreters (and elsewhere than Linux they
always are).

A process forked from the server may have the same server fork its own processes
(:func:`adopt_server`: ``shoal train``'s work, whose workers come from its command's server).
A forked process starts with the server's environment and standard output and error as
they were when the server started: :func:`run_as_launched` gives it the launcher's as they
are now, before anything of the target runs (multiprocessing gives it the launcher's
working folder and ``sys.path``). The server and its children never outlive
this process (:mod:`shoal.core.zygote`, :mod:`shoal.core.guard`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import select
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from multiprocessing import popen_forkserver
from multiprocessing.context import BaseContext
from typing import Any

from shoal.core import guard, logs
from shoal.errors import JobError

#: What the server imports once for every process it forks; the first blocks SIGTERM.
PRELOAD = ["shoal.core.zygote", "torch", "torch.distributed"]
#: A training worker's modules (``shoal.train`` imports them only on first use).
TRAINING = ("shoal.train.job", "shoal.train.trainer", "shoal.train.workload")


def start_method() -> str:
    """``forkserver`` on Linux unless ``SHOAL_START_METHOD`` says ``spawn`` or the server's
    socket would not fit in the temporary folder (a Unix socket's path holds 107 bytes:
    a long ``TMPDIR`` leaves no room)."""
    asked = os.environ.get("SHOAL_START_METHOD", "forkserver")
    if asked == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    if len(os.fsencode(os.path.join(mp.util.get_temp_dir(), "listener-12345678"))) > 100:
        return "spawn"
    return "forkserver"


def server_modules(compile: bool, trains: bool) -> list[str]:
    """What the server imports besides :data:`PRELOAD`: :data:`TRAINING` for a job whose
    workers train (each would import it, about 0.6 s of CPU apiece), ``torch._dynamo`` for
    one that compiles."""
    return [*TRAINING] * trains + ["torch._dynamo"] * compile


def context(more: Sequence[str] = ()) -> BaseContext:
    """The multiprocessing context shoal starts its processes in (see :func:`start_method`);
    a server it starts imports ``more`` modules too."""
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([*PRELOAD, *more])  # heeded when the server starts
    return ctx


class _ReapedOnce(popen_forkserver.Popen):
    """multiprocessing's forked-process handle, whose exit status any thread may ask for.

    The server sends a child's exit status once, down a pipe: two threads asking at the same
    time (a watcher thread, and ``join`` in the main one) both see the pipe ready, one reads
    the status and the other end-of-file, which multiprocessing reports as status 255 ("the
    server died"). Here the read is made once, under a lock; a thread that finds another
    inside it hears "not known yet" (as before the child ended) unless it waits anyway."""

    def __init__(self, process_obj: Any) -> None:
        self._read_lock = threading.Lock()
        super().__init__(process_obj)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None:
            timeout = 0 if flag == os.WNOHANG else None
            if not mp.connection.wait([self.sentinel], timeout):
                return None
            # Blocking only where the caller blocks (join): a signal handler asking while
            # this thread is inside the read (shoal's launcher passing SIGTERM on) gets
            # "not known yet" instead of waiting for itself.
            if not self._read_lock.acquire(blocking=flag != os.WNOHANG):
                return None
            try:
                if self.returncode is None:
                    try:
                        self.returncode = mp.forkserver.read_signed(self.sentinel)
                    except (OSError, EOFError):  # the server itself is gone
                        _SERVER["cut"] = 1
                        self.returncode = _status_without_server(self.pid, flag)
            finally:
                self._read_lock.release()
        return self.returncode


def _status_without_server(pid: int, flag: int) -> int | None:
    """A forked process's exit status once the server that would have sent it is gone. An
    orphan this process adopted (``shoal``'s command is a child subreaper:
    :mod:`shoal.core.descendants`; its work process outlives the server) is waited for
    here (``None``: still running, where ``flag`` does not block); any other died with the
    server (its death signal), which multiprocessing reports as status 255."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            done, status = os.waitpid(pid, flag)
        except ChildProcessError:
            # The server's pipe ends before its children are handed on: wait for that. A
            # child handed on since the wait above is this process's now: wait again.
            handing = guard.parent_of(pid) in (_SERVER.get("pid"), os.getpid())
            if handing and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            return 255
        return os.waitstatus_to_exitcode(status) if done else None


#: The server this process forks from (``pid``) and a pidfd of it (``fd``), once known.
_SERVER: dict[str, int] = {}


def _watch_server(pid: int) -> None:
    if "fd" in _SERVER:
        os.close(_SERVER["fd"])
    _SERVER.clear()
    with contextlib.suppress(OSError):
        _SERVER.update(pid=pid, fd=os.pidfd_open(pid))


def server_lost(wait: float = 1.0) -> str | None:
    """How the server this process forks its processes from was lost (killed while the job
    ran: every process it forked ends with it), as a phrase; ``None`` while it runs or
    where there is none. Asked after a failure: the server's connections end before it
    does, so where one ended here its end is waited for up to ``wait`` seconds (where none
    did, the statuses came from a live server: a failed worker is reported at once)."""
    fd = _SERVER.get("fd")
    if fd is None or not select.select([fd], [], [], wait if "cut" in _SERVER else 0)[0]:
        return None
    pid, how = _SERVER["pid"], ""
    with contextlib.suppress(OSError):  # its status: only its parent (the command) reads it
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            how = f": killed by {signal.Signals(info.si_status).name}"
    return f"the server that forks the job's processes (pid {pid}) was lost{how}"


class _ForkServerProcess(mp.context.ForkServerProcess):  # type: ignore[name-defined,misc]
    @staticmethod
    def _Popen(process_obj: Any) -> _ReapedOnce:
        return _ReapedOnce(process_obj)


def new_process(target: Callable[..., Any], args: tuple[Any, ...], **kwargs: Any) -> Any:
    """A process object (not started) in shoal's context that runs ``target(*args)`` in this
    process's environment and standard output and error as they are now
    (:func:`run_as_launched`; multiprocessing gives it the working folder and ``sys.path``);
    ``kwargs``: the rest of ``Process``'s arguments."""
    ctx = context()
    forked = ctx.get_start_method() == "forkserver"
    run_args = (dict(os.environ), _Streams() if forked else None, forked, target, args)
    if forked:
        return _ForkServerProcess(target=run_as_launched, args=run_args, **kwargs)
    return ctx.Process(target=run_as_launched, args=run_args, **kwargs)


def start_guarded(process: Any) -> None:
    """Start ``process`` (of :func:`new_process`) with :mod:`shoal.core.guard` as the main
    module it runs first, in place of this process's own.

    The spawn Popen reads ``sys.modules["__main__"]`` (to tell the child what to run as its
    main module; the forkserver's child runs it too) and pickles the process object inside
    ``start()``, and nowhere else: a stand-in ``__main__`` whose file is guard.py for that
    moment makes the child run the guard and nothing of the caller's (``shoal/__main__.py``
    would run the command again). The window is the few ms of ``start()``; a thread
    pickling a ``__main__`` object by reference meanwhile would fail."""
    main = sys.modules["__main__"]
    stand_in = types.ModuleType("__main__")
    stand_in.__file__ = os.path.abspath(guard.__file__)
    sys.modules["__main__"] = stand_in
    try:
        process.start()
        _note_server()
    except (OSError, EOFError):
        _SERVER["cut"] = 1
        lost = server_lost() if _ADOPTED else None
        if lost is not None:  # the command's server: none of its own to start instead
            raise JobError(f"{lost}; no process of the job can start") from None
        raise
    finally:
        sys.modules["__main__"] = main


def server_address() -> str | None:
    """The address of the server this process started (or adopted), or ``None``."""
    if start_method() != "forkserver":
        return None
    return getattr(mp.forkserver._forkserver, "_forkserver_address", None)  # type: ignore[attr-defined]


_ADOPTED = False


def adopt_server(address: str) -> None:
    """In a process forked from the server at ``address``: start this process's own
    processes from that server too, instead of a server of its own (whose start would import
    torch once more). This process does not keep the server alive: it ends with the process
    that started it, and this one with it (:func:`shoal.core.guard.guard_child`); a request
    hands the server a stand-in for the pipe end that ties a child to that process, which
    the child gives up first thing (:func:`_leave_server`)."""
    global _ADOPTED
    server = mp.forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = address
    server._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)
    server.ensure_running = mp.resource_tracker.ensure_running  # never a server of its own
    _ADOPTED = True
    _watch_server(os.getppid())  # this process was forked from it


def ensure_server(more: Sequence[str] = ()) -> None:
    """Start the server that forks shoal's processes now, if this process has none yet and
    uses one: it imports torch (and ``more``: ``torch._dynamo`` for workers that compile)
    while this process does other work. A server already running
    keeps what it imported; a process forked from it imports the rest itself."""
    if start_method() == "forkserver" and not _ADOPTED:
        context(more)
        mp.forkserver.ensure_running()
        _note_server()


def _note_server() -> None:
    """Watch the server this process started (:func:`server_lost`), a new one included."""
    pid = getattr(mp.forkserver._forkserver, "_forkserver_pid", None)  # type: ignore[attr-defined]
    if pid is not None and not _ADOPTED and _SERVER.get("pid") != pid:
        _watch_server(pid)


def stop_server() -> None:
    """End the server this process started, now, if there is one. It would end by itself
    once this process exits, but only after its imports: seconds of CPU that a command
    which failed its checks would leave running behind it. Every process it forked has ended
    by then or ends with it (:func:`shoal.core.guard.guard_child`)."""
    server = mp.forkserver._forkserver  # type: ignore[attr-defined]
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        server._stop()  # closes this end of its pipe, reaps it, removes its socket


def stop_tracker(timeout: float = 5.0) -> None:
    """End multiprocessing's resource tracker, if this process started it: it unlinks what
    the processes it served left registered, then exits, once no process holds its pipe
    (this one lets go of its end here; the job's have ended). Waits ``timeout`` seconds
    at most."""
    tracker = mp.resource_tracker._resource_tracker  # type: ignore[attr-defined]
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return
    tracker._fd = tracker._pid = None
    with contextlib.suppress(OSError):
        os.close(fd)
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)


def tracker_pid() -> int | None:
    """The pid of the resource tracker this process started, or ``None``."""
    return getattr(mp.resource_tracker._resource_tracker, "_pid", None)  # type: ignore[attr-defined]


class _Streams:
    """This process's stdout and stderr as they are when a process starts (a launcher's may
    point elsewhere than when its server started: pytest's capture, a user's redirection),
    sent along and put in place in that process as it is unpickled."""

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return _take_streams, tuple(DupFd(fd) if _is_open(fd) else None for fd in (1, 2))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _take_streams(*sent: Any) -> None:
    for fd, dup in zip((1, 2), sent, strict=True):
        if dup is not None:
            mine = dup.detach()
            if mine != fd:
                os.dup2(mine, fd)
                os.close(mine)


def _leave_server() -> None:
    """Give up what a forked process holds of its server: the end of the pipe whose closing
    by the launcher (its death, however it comes) ends the server (multiprocessing hands it
    to each child, so the server would wait for every child too, and a child waits for the
    server's death to end: ``guard_child``), and the server's address, so that a process it
    starts itself comes from a server of its own."""
    server = mp.forkserver._forkserver  # type: ignore[attr-defined]
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
    for name in ("_forkserver_alive_fd", "_forkserver_address", "_forkserver_pid"):
        if hasattr(server, name):
            setattr(server, name, None)


def run_as_launched(environ: dict[str, str], streams: None, forked: bool,
                    target: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Take the launcher's ``environ`` (``streams``, its standard output and error, are in
    place once unpickled) and unblock SIGTERM (the server blocks it: one that came meanwhile
    ends this process now), then run ``target(*args)``. ``kill -USR1`` then prints where
    each of its threads is (Python's ``faulthandler``), unless the target takes SIGUSR1.

    A ``forked`` process then ends as an interpreter does: its threads joined, then its
    exit handlers run (``atexit``: a user's, torch's); multiprocessing ends a forked child
    with ``os._exit``, which skips both. (It also skips the last garbage collection, which
    a spawned shoal process skips too: :func:`shoal.core.guard.skip_exit_collection`.)
    """
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    guard.show_threads_on_usr1()  # kill -USR1: where is it stuck?
    if forked:
        _leave_server()
    guard.name_process(guard.title_of(mp.current_process().name))  # not the server's
    os.environ.clear()
    os.environ.update(environ)
    logs.install()  # the lines the command shows, as the command shows them
    try:
        return target(*args)
    finally:
        if forked:
            threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit
            atexit._run_exitfuncs()
