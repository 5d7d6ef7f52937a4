"""A warm interpreter the suite's ``python -m shoal ...`` (and torchrun) commands fork from.

Each test process of ``make test`` starts one (:func:`launch`): it imports torch and shoal
once, then forks a process for each command a test runs (:class:`WarmPopen`, a
:class:`subprocess.Popen` in every way a test uses one). That process is the command as
``python -m shoal ARGS`` would be, but for its start: the test's arguments, environment,
working folder, session and standard streams, and the command line and environment that
``/proc/PID/cmdline`` and ``/proc/PID/environ`` show (the suite finds a test's processes by
the latter). The server the command starts for its workers is forked from it too, not
started as a fresh interpreter, but runs the same code (multiprocessing's own ``main``):
each command saves the import of torch (and of shoal's training modules) that its
process or its server made: about 1.3 s of CPU, most of what a small job costs. Under
torchrun (``python -m torch.distributed.run``), its own process is forked from here, and so
are its ranks (``python -u -m MODULE`` or ``python -u SCRIPT``): torchrun asks this
interpreter for them, so a rank's parent is this interpreter, not torchrun (a test that
signals a rank's parent runs cold).

What a fresh interpreter would do differently is not tested through this: tests of a
command's start-up (what it imports, when its server starts) run it cold, and so does a
command whose environment asks for what is read as an interpreter starts (``PYTHON*`` but
``PYTHONPATH``, ``OMP_*``, ``--debug``'s native log level): :func:`can_run`.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Room for the commands' arguments and environments in the warm interpreter's own (a
#: forked process shows its arguments and environment where the interpreter's were).
ARGV_ROOM, ENV_ROOM = 8192, 65536
#: Variables read as an interpreter or torch's libraries start: a command whose environment
#: sets any of them otherwise than the warm interpreter's runs cold.
READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "TORCH_CPP_LOG_LEVEL", "MALLOC_")
_STATUS = struct.Struct("<q")
#: torchrun's module: its own process is forked from here too, and its ranks.
TORCHRUN = "torch.distributed.run"


def _fields() -> list[str]:
    stat = Path("/proc/self/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def _block(items: list[str]) -> bytes:
    """``items`` as a process's arguments or environment lie in its memory."""
    return b"".join(os.fsencode(item) + b"\0" for item in items)


def _environ(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


def _write_area(start: int, end: int, items: list[str]) -> None:
    """Put ``items`` (NUL-separated, NUL-padded) where this process's original arguments or
    environment lie (``/proc/PID/stat``'s fields 48-51): what ``/proc/PID/cmdline`` and
    ``environ`` read. They fit (:func:`can_run` checked)."""
    data = _block(items)
    assert len(data) <= end - start, "the warm interpreter has no room for them"
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


# -- the warm interpreter ---------------------------------------------------------------
def _close_other_fds(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _fork_exec_or_fork(path: str, args: list[str], passfds: Any) -> int:
    """multiprocessing's ``spawnv_passfds`` for a command forked from here: the server it
    starts (``-c 'from multiprocessing.forkserver import main; ...'``) is forked from the
    command, which imported what that server imports, where the command still runs one
    thread; anything else is executed as ever."""
    code = args[-1]
    if not code.startswith("from multiprocessing.forkserver import main") or \
            len(os.listdir("/proc/self/task")) != 1:
        return _SPAWN(path, args, passfds)
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        import atexit
        import multiprocessing.forkserver as forkserver
        import multiprocessing.resource_tracker as tracker

        atexit._clear()  # the command's exit handlers are not the server's
        _close_other_fds({0, 1, 2, *map(int, passfds)})
        fields = _fields()
        _write_area(int(fields[45]), int(fields[46]), args)
        server = forkserver._forkserver
        server._lock = threading.Lock()  # held by the command's thread as it forked
        server._forkserver_address = server._forkserver_alive_fd = None
        server._forkserver_pid = None
        tracker._resource_tracker._fd = tracker._resource_tracker._pid = None
        tracker._resource_tracker._lock = threading.RLock()
        sys.modules.pop("shoal.core.zygote", None)  # its first import is the server's own
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 0
        atexit._run_exitfuncs()
    finally:
        os._exit(status)


_SPAWN: Any = None
_TITLE: Any = None


def _titled(title: str) -> None:
    """``setproctitle.setproctitle`` in a command forked from here: the arguments written
    where the interpreter's were are cleared first (setproctitle clears its first 256 bytes
    only, as a fresh process has nothing after them)."""
    fields = _fields()
    start, end = int(fields[45]), int(fields[46])
    ctypes.memset(start, 0, end - start)
    _TITLE(title)


def _form(args: list[str]) -> tuple[bool, str, str] | None:
    """What ``args`` run: (``-u`` given, ``-m``'s module or "", the script or ""), for the
    forms a test's command (``python -m MODULE ...``) and a torchrun rank (``python -u -m
    MODULE ...``, ``python -u SCRIPT ...``) take; ``None`` for any other."""
    if args[:1] != [sys.executable]:
        return None
    unbuffered = args[1:2] == ["-u"]
    rest = args[1 + unbuffered:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return unbuffered, rest[1], ""
    if unbuffered and rest and rest[0].endswith(".py") and os.path.isfile(rest[0]):
        return unbuffered, "", rest[0]
    return None


def _run_command(request: dict[str, Any]) -> int:
    """In the forked process: become ``python -m shoal ARGS`` (or a form :func:`_form`
    reads) as ``request`` says; its status."""
    import atexit
    import runpy

    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    fields = _fields()
    argv = request["args"]
    _write_area(int(fields[45]), int(fields[46]), argv)
    _write_area(int(fields[47]), int(fields[48]), _environ(env))
    unbuffered, module, script = _form(argv) or (False, "", "")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()
    sys.path[:] = [first, *paths, *_BASE_PATH]
    sys.argv = [argv[0], *argv[3 + unbuffered:]] if module else argv[2:]
    _as_started(unbuffered, env.get("OMP_NUM_THREADS"))
    if module == TORCHRUN:
        _ranks_forked_here(env)
    status = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            status = 0
        elif isinstance(stop.code, int):
            status = stop.code
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:  # as an interpreter ends on one: by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as an interpreter's exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return status


_BASE_PATH: list[str] = []
#: Where this warm interpreter serves (a torchrun forked from it asks it for its ranks).
_ADDRESS: list[str] = []


def _as_started(unbuffered: bool, threads: str | None) -> None:
    """What ``-u`` and ``OMP_NUM_THREADS`` (torchrun's ranks get both) would have done as the
    interpreter and torch started: streams that write through, torch's intra-op threads."""
    if unbuffered:
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                                encoding=old.encoding, errors=old.errors,
                                                write_through=True))
    if threads is not None and threads.isdigit():  # as the warm interpreter's otherwise
        import torch

        torch.set_num_threads(int(threads))


def _starts_as(args: list[str], env: dict[str, str], like: dict[str, str],
               free: frozenset[str] = frozenset({"PYTHONPATH"})) -> bool:
    """Whether ``args`` and ``env`` fit the room a forked process shows them in, and ``env``
    sets what an interpreter reads as it starts as ``like`` does (but the ``free`` ones)."""
    if len(_block(args)) > ARGV_ROOM or len(_block(_environ(env))) > ENV_ROOM:
        return False
    keys = {k for k in env.keys() | like.keys() if k.startswith(READ_AT_START)}
    return all(env.get(k) == like.get(k) for k in keys - free)


def _rank_alike(args: list[str], env: dict[str, str], agent: dict[str, str]) -> bool:
    """Whether torchrun's rank ``args`` with ``env`` runs alike forked from here: a form
    :func:`_form` reads, started as torchrun's own environment ``agent`` (which ran alike)
    says, but ``OMP_NUM_THREADS`` as a whole number (:func:`_as_started` sets it)."""
    threads = env.get("OMP_NUM_THREADS", "1")
    return _form(args) is not None and threads.isdigit() and int(threads) > 0 and \
        _starts_as(args, env, agent, frozenset({"PYTHONPATH", "OMP_NUM_THREADS"}))


def _ranks_forked_here(agent: dict[str, str]) -> None:
    """In a torchrun forked from here: its ranks are forked from here too where they run
    alike (:func:`_rank_alike`): children of this interpreter, not of torchrun, which
    watches, signals and waits for them through :class:`WarmPopen` as through any Popen."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler,
    )

    fresh = handler.SubprocessHandler._popen

    def forked(self: Any, args: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen:
        if not _rank_alike(list(args), env, agent):
            return fresh(self, args, env)
        return WarmPopen(list(args), address=_ADDRESS[0], env=env, stdout=self._stdout,
                         stderr=self._stderr, start_new_session=True)

    handler.SubprocessHandler._popen = forked


def _serve_request(conn: socket.socket, listener: socket.socket) -> int:
    """Fork the command ``conn`` asks for; its pid (0 where the request was unreadable)."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    request, pid = None, 0
    with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError):
        if len(head) == 8 and len(fds) == 3:
            request = pickle.loads(_recv_exactly(conn, int.from_bytes(head, "little")))
    if request is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
    if pid or request is None:  # the streams are the command's alone
        for fd in fds:
            os.close(fd)
        return pid
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd, target in zip(fds, (0, 1, 2), strict=True):
            os.dup2(fd, target)
        conn.detach()
        listener.detach()
        _close_other_fds({0, 1, 2})
        status = _run_command(request)
    except BaseException:
        with contextlib.suppress(Exception):
            sys.excepthook(*sys.exc_info())
    finally:
        os._exit(status)


def serve(address: str) -> None:
    """The warm interpreter's loop: fork each command asked for at ``address``, answer its
    pid, then its wait status when it ends. Ends with the process that started it."""
    global _SPAWN, _TITLE
    import multiprocessing.util

    import setproctitle

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it ends with the test process
    # setproctitle finds the room of the arguments now, before a command's are written there.
    os.environ["SPT_NOENV"] = "1"
    setproctitle.setproctitle("shoal-warm-interpreter")
    del os.environ["SPT_NOENV"]
    _TITLE = setproctitle.setproctitle
    setproctitle.setproctitle = _titled
    _SPAWN = multiprocessing.util.spawnv_passfds
    multiprocessing.util.spawnv_passfds = _fork_exec_or_fork
    _BASE_PATH[:] = [p for p in sys.path[1:]
                     if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    wake = os.pipe()
    os.set_blocking(wake[0], False)
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _ADDRESS[:] = [address]
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address + ".new")
    os.rename(address + ".new", address)  # ready once it is there
    listener.listen(16)
    waiting: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, wake[0]], [], [], 1.0)
        if listener in ready:
            conn = listener.accept()[0]
            with contextlib.suppress(OSError):  # the test's end of it closed early
                pid = _serve_request(conn, listener)
                if pid:
                    conn.sendall(_STATUS.pack(pid))
                    waiting[pid] = conn
                    continue
            conn.close()
        with contextlib.suppress(BlockingIOError):
            os.read(wake[0], 4096)
        _reap(waiting)


def _reap(waiting: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(_STATUS.pack(status))
            conn.close()


# -- a test's side ----------------------------------------------------------------------
def launch(address: str, env: dict[str, str]) -> subprocess.Popen:
    """Start a warm interpreter that will serve at ``address`` (a path in a folder only this
    user reaches), with ``env``; it imports torch meanwhile (:func:`ready`)."""
    env = {**env, "SHOAL_WARM_ROOM": "x" * ENV_ROOM, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    return subprocess.Popen([sys.executable, __file__, address, "-" * ARGV_ROOM], env=env,
                            stdin=subprocess.DEVNULL)


def ready(proc: subprocess.Popen, address: str, timeout: float = 120) -> bool:
    """Whether the warm interpreter ``proc`` serves at ``address``, waiting for it up to
    ``timeout`` seconds where it still starts. Not ready by then: it is stopped."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            return False
        time.sleep(0.05)
    return proc.poll() is None


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def can_run(args: list[str], env: dict[str, str], warm_env: dict[str, str]) -> bool:
    """Whether ``args`` (``python -m shoal ...`` or ``python -m torch.distributed.run ...``)
    with ``env`` runs alike forked from a warm interpreter started with ``warm_env``."""
    form = _form(args)
    return form is not None and not form[0] and form[1] in ("shoal", TORCHRUN) and \
        "--debug" not in args and _starts_as(args, env, warm_env)


class WarmPopen(subprocess.Popen):
    """:class:`subprocess.Popen` of a command forked from the warm interpreter at
    ``address``: its pid, pipes, signals and timeouts as ever; its status comes from that
    interpreter, its parent."""

    def __init__(self, args: list[str], *, address: str, **kwargs: Any) -> None:
        self._address = address
        self._conn: socket.socket | None = None
        super().__init__(args, **kwargs)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any,
                       pass_fds: Any, cwd: Any, env: Any, startupinfo: Any,
                       creationflags: Any, shell: Any, p2cread: int, p2cwrite: int,
                       c2pread: int, c2pwrite: int, errread: int, errwrite: int,
                       *rest: Any) -> None:
        start_new_session = rest[5]
        stdin = p2cread if p2cread != -1 else os.open(os.devnull, os.O_RDONLY)
        fds = [stdin, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        body = pickle.dumps({"args": list(args), "env": dict(os.environ if env is None else env),
                             "cwd": os.fspath(cwd or os.getcwd()),
                             "session": bool(start_new_session)})
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.settimeout(30)
            conn.connect(self._address)
            socket.send_fds(conn, [len(body).to_bytes(8, "little")], fds)
            conn.sendall(body)
            self.pid = _STATUS.unpack(_recv_exactly(conn, _STATUS.size))[0]
        except BaseException:
            conn.close()
            raise
        finally:
            if p2cread == -1:
                os.close(stdin)
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        conn.settimeout(None)
        self._conn = conn
        self._child_created = True

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        conn = self._conn
        if conn is None:
            return self.pid, 0
        if wait_flags & os.WNOHANG and not select.select([conn], [], [], 0)[0]:
            return 0, 0
        try:
            status = _STATUS.unpack(_recv_exactly(conn, _STATUS.size))[0]
        except OSError:  # the warm interpreter is gone: so is its child
            status = signal.SIGKILL
        conn.close()
        self._conn = None
        return self.pid, status

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the warm interpreter closed the connection")
        data += chunk
    return data


if __name__ == "__main__":
    import torch  # noqa: F401  what every command's process and server import
    import torch.distributed  # noqa: F401

    import shoal.cli  # noqa: F401
    from shoal.core.starting import TRAINING

    for module in TRAINING:
        __import__(module)
    serve(sys.argv[1])
