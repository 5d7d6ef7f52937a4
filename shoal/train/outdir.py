"""One run per output directory: an advisory lock held for the life of a run.

The lock is ``OUT/.shoal.lock``, locked with ``flock`` by the process that runs the job
(the launcher; rank 0 under torchrun, Slurm or mpirun) and removed when the run ends. The
kernel releases it when that process dies, however it dies, so a killed run never leaves
a directory locked. The file holds the owner's pid and host, for the error a second run gets.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from types import TracebackType

from shoal.core.files import make_output_dir
from shoal.core.trust import open_own
from shoal.errors import ShoalError

LOCK_NAME = ".shoal.lock"


class OutputLock:
    """``with OutputLock(out):`` -- hold ``out`` for this run or raise a one-line error."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        make_output_dir(self.path.parent)  # or one line: under /proc, no permission, ...
        while True:
            # Never through a link, and only a lock file of this user's: truncating one
            # planted as a link to another file would destroy that file.
            fd = open_own(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ShoalError(f"--out {self.path.parent} is in use by another shoal run "
                                 f"({owner}); wait for it to end or choose another --out") from None
            # The owner before us may have removed the file between our open and our lock:
            # then we hold a lock on a name nobody else sees. Only the current file counts.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: see acquire()
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
