"""The TCP connections a process group opened, so that a group left behind can be cut.

A member that left a collective in flight (``--elastic``, a failed meeting) cannot destroy
that group until the collective ends, and the collective waits for peers that have left it
too: each keeps its old group until Gloo's timeout (minutes). Meanwhile data a peer had
sent for it sits unread in a connection, and Gloo's loop thread, which reads only into a
buffer posted for it, wakes on it again and again: a core busy for nothing per old group.
Shutting the group's own connections down ends its collectives here and at every peer at
once (Gloo sees the connection closed), so the group can be destroyed.

Which sockets are the group's: those the process opened while it joined the group, less
any connection to or from the job's store. Linux only (``/proc``); elsewhere nothing is
found and nothing is cut (the group is then kept until its collective times out).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shoal.core.sealed import SealedStore

LISTEN = "0A"  # a listening socket's state in /proc/net/tcp


def socket_inodes() -> dict[int, int]:
    """This process's open sockets: inode -> descriptor."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:["):
                    found[int(link[8:-1])] = int(name)
    return found


def connections() -> dict[int, tuple[int, int]]:
    """This process's network namespace's TCP connections (not listening sockets: Gloo's
    listener, shut down, ends the process): inode -> (local port, remote port)."""
    ports: dict[int, tuple[int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                with contextlib.suppress(IndexError, ValueError):
                    if fields[3] != LISTEN:
                        ports[int(fields[9])] = (int(fields[1].rsplit(":", 1)[1], 16),
                                                 int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def store_port(store: Any) -> int | None:
    """The TCP port of the store under ``store`` (through its prefixes), if it is a TCPStore
    (sealed or not)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return int(store.port) if isinstance(store, (dist.TCPStore, SealedStore)) else None


@contextlib.contextmanager
def opened(store: Any) -> Iterator[set[int]]:
    """The inodes of the TCP connections this process opens in the body, less those to or
    from ``store``'s port (filled in when the body ends)."""
    before = set(socket_inodes())
    found: set[int] = set()
    yield found
    port, ports = store_port(store), connections()
    found.update(inode for inode in socket_inodes()
                 if inode not in before and inode in ports and port not in ports[inode])


def cut(inodes: set[int]) -> int:
    """Shut down both ways each socket of ``inodes`` this process still has open, through a
    duplicate of its descriptor checked to be that socket (its owner may close and reuse
    the number meanwhile); returns how many."""
    done = 0
    for inode, fd in socket_inodes().items():
        if inode not in inodes:
            continue
        try:
            mine = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(mine).st_ino != inode:
                continue
            sock = socket.socket(fileno=mine)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:  # closed already: nothing to end
                pass
            finally:
                sock.detach()  # the duplicate is closed below, once
        finally:
            os.close(mine)
    return done
