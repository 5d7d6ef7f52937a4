"""A job's shared-memory segment in ``/dev/shm``, named so that nobody else finds it and
nothing is left behind: created owner-only under a random name, mapped by every rank, and
unlinked by its creator once all have mapped it (the memory goes with the last mapping).
Segments whose creator was killed before it unlinked are swept by the next creator (the
creator's process id is in the name). Used by :mod:`shoal.core.intrahost` and
:mod:`shoal.core.mailbox`."""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import re
import secrets
import socket
import sys
from pathlib import Path

from shoal.core.descendants import pid_alive

#: Where POSIX shared memory lives on Linux.
SHM_DIR = "/dev/shm"
#: The segments' names: ``shoal-<use>-<creator pid>-<random>``, the use ``ih`` (a host's
#: sums, :mod:`shoal.core.intrahost`) or ``ps`` (a parameter server's pair,
#: :mod:`shoal.core.mailbox`).
_NAME = re.compile(r"^shoal-(?:ih|ps)-(\d+)-[0-9a-f]{32}$")


def segment_name(use: str = "ih") -> str:
    """A fresh segment name for ``use`` (``ih`` or ``ps``): this process's id and 128 random
    bits."""
    return f"shoal-{use}-{os.getpid()}-{secrets.token_hex(16)}"


def creator(name: str) -> int | None:
    """The id of the process that made the segment ``name``; ``None``: not a name of
    :func:`segment_name`'s."""
    match = _NAME.match(name)
    return None if match is None else int(match.group(1))


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove this user's segments whose creator is gone (killed before it unlinked);
    returns their names."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid = creator(name)
            if pid is None or pid_alive(pid):
                continue
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if os.stat(path).st_uid == os.getuid():
                    os.unlink(path)
                    removed.append(name)
    return removed


def create_segment(name: str, size: int, directory: str = SHM_DIR) -> mmap.mmap:
    """Create the segment ``name`` of ``size`` bytes, readable by this user only, and map it.
    Its memory is taken now: a full ``/dev/shm`` (64 MB in a container by default) fails
    here with ``OSError``, not later with a SIGBUS in whichever process first writes a page.
    """
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError:
        unlink_segment(name, directory)
        raise
    finally:
        os.close(fd)


def open_segment(name: str, size: int, directory: str = SHM_DIR) -> mmap.mmap:
    """Map the segment ``name`` that another rank created; it must be ``size`` bytes."""
    if _NAME.match(name) is None:
        raise ValueError(f"not a segment name: {name!r}")
    fd = os.open(os.path.join(directory, name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"segment {name} is not {size} bytes")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink_segment(name: str, directory: str = SHM_DIR) -> None:
    """Remove the segment's name (its mappings stay valid)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, name))


def host_key() -> str:
    """What tells this host from another: its name, its boot and its network namespace (an
    emulated host of :mod:`shoal.emulate` is a namespace of one machine, and its slow link
    is the point: it must not be bypassed)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/net", "/proc/self/ns/ipc"):
        try:
            parts.append(os.readlink(path) if path.startswith("/proc/self")
                         else Path(path).read_text().strip())
        except OSError:
            parts.append("?")
    return "|".join(parts)


def unavailable_here(device_type: str) -> str | None:
    """Why this process cannot take the fast path (``None``: it can)."""
    if sys.platform != "linux" or not os.path.isdir(SHM_DIR):
        return f"no {SHM_DIR} here"
    if platform.machine() not in ("x86_64", "AMD64"):
        return (f"{platform.machine()} may reorder stores; its barriers are written for "
                "x86-64 only")
    if device_type != "cpu":
        return f"its tensors are on {device_type}"
    return None


def pid_space() -> str:
    """This process's pid namespace: processes in different ones cannot watch each other by
    process id."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"
