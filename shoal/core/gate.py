"""An owner-only door to a one-host job's store: other users of the machine cannot connect.

torch's ``TCPStore`` takes every connection that reaches its port, and on one host every local
user reaches loopback. Its libuv server cannot listen on a Unix socket (it sets
``TCP_NODELAY`` on the socket it is handed, which a Unix socket refuses), so a :class:`Gate`
stands in front of it instead, on Linux:

- the gate listens on ``127.0.0.1:PORT``, the address the job's processes are given. For
  each connection it accepts, it looks up the uid that owns the connecting socket in
  ``/proc/net/tcp`` (the row whose local address is the connection's peer). A connection
  of another user is closed at once, before a byte of it reaches the store, and said once
  per user (:func:`refused_line`); one of this process's own user is carried both ways to
  the store;
- the store itself listens on ``127.0.0.2:PORT`` (the same port number, so that torch's own
  first connection, made to ``127.0.0.1:PORT``, comes through the gate too). A socket
  filter (classic BPF, no privilege needed) attached before it listens drops every packet
  that does not come from ``127.0.0.1`` and from a port the gate has just bound for a
  connection of its own: a connection made to it directly never forms.

Another user cannot take one of the gate's source ports: the gate binds it without
``SO_REUSEADDR``, so nobody else can bind that port until the gate's socket is closed, and
the port leaves the filter before that (once the store has answered on the connection: the
store's side of it has been made by then and keeps its own copy of the filter).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable

log = logging.getLogger("shoal.store")

#: Where the gate listens (the job's processes connect here) and where the store listens.
OUTER_HOST, INNER_HOST = "127.0.0.1", "127.0.0.2"
#: ``SO_ATTACH_FILTER`` (Linux; Python's socket module does not name it).
SO_ATTACH_FILTER = 26
#: Classic BPF: where the network header starts, for an absolute load.
SKF_NET_OFF = -0x100000
#: Source ports the filter lets in at once (two instructions each, of the kernel's 4096).
MOST_PENDING = 1000
#: Bytes read at once from either side of a carried connection.
CHUNK = 1 << 16
#: ``/proc/net/tcp``'s state of an established connection.
ESTABLISHED = "01"


def supported() -> bool:
    """Whether this machine can gate a store: Linux, with ``/proc/net/tcp`` readable."""
    return sys.platform.startswith("linux") and os.access("/proc/self/net/tcp", os.R_OK)


def open_gate() -> Gate | None:
    """A new :class:`Gate`, or ``None`` where this machine cannot have one: not Linux (the
    store is then reached as torch serves it), or the kernel refuses the filter (said in
    one line: the store's values stay sealed, but other users can connect).

    Raises:
        OSError: no pair of free ports could be found.
    """
    if not supported():
        return None
    try:
        return Gate()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise
        log.warning(f"shoal: the job's store is not gated ({exc}): other users of this machine "
                    "can connect to it (its keys and values stay sealed)")
        return None


def store_listener() -> tuple[int, Gate | None]:
    """A listening socket for a new one-host store (``master_listen_fd``: the store closes
    it) and the gate in front of it (:func:`open_gate`); where there is none, the socket
    listens on ``127.0.0.1`` itself.

    Returns:
        The socket's descriptor, and the gate to close with the store (or ``None``).

    Raises:
        OSError: no port could be bound.
    """
    gate = open_gate()
    if gate is not None:
        return gate.listener_fd(), gate
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((OUTER_HOST, 0))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock.detach(), None


def refused_line(uid: int) -> str:
    """The one line that reports the refused connections of user ``uid``."""
    return (f"shoal: refused a connection to the job's store from another user (uid {uid}) "
            "of this machine")


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def port_filter(ports: Iterable[int]) -> bytes:
    """A classic BPF program for a TCP socket that keeps the packets sent from
    ``127.0.0.1`` and one of ``ports``, and drops every other.

    Args:
        ports: the source ports let in.

    Returns:
        The program's instructions, as ``SO_ATTACH_FILTER`` takes them.
    """
    ld_w, ld_h, jeq, ret = 0x20, 0x28, 0x15, 0x06  # BPF_LD|BPF_ABS (W, H), BPF_JMP|BPF_JEQ|BPF_K
    loopback = int.from_bytes(socket.inet_aton(OUTER_HOST), "big")
    code = [_insn(ld_w, 0, 0, SKF_NET_OFF + 12),  # the IPv4 source address
            _insn(jeq, 1, 0, loopback), _insn(ret, 0, 0, 0),
            _insn(ld_h, 0, 0, 0)]  # the TCP source port (a TCP socket's data starts there)
    for port in ports:
        code += [_insn(jeq, 0, 1, port), _insn(ret, 0, 0, 0xFFFFFFFF)]
    code.append(_insn(ret, 0, 0, 0))
    return b"".join(code)


def attach_filter(sock: socket.socket, program: bytes) -> None:
    """Attach the classic BPF ``program`` (:func:`port_filter`) to ``sock``, in place of
    the one it has.

    Raises:
        OSError: the kernel refused it.
    """
    buffer = ctypes.create_string_buffer(program, len(program))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                    struct.pack("HL", len(program) // 8, ctypes.addressof(buffer)))


def _hex(address: tuple[str, int], six: bool) -> str:
    """``address`` as ``/proc/net/tcp`` (``six``: ``tcp6``, IPv4-mapped) writes it."""
    raw = socket.inet_aton(address[0])
    if six:
        raw = bytes(10) + b"\xff\xff" + raw
    words = "".join(f"{int.from_bytes(raw[i:i + 4], sys.byteorder):08X}"
                    for i in range(0, len(raw), 4))
    return f"{words}:{address[1]:04X}"


def owner_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid owning the socket at ``peer`` that is connected to ``local`` (both IPv4, in
    this network namespace), or ``None`` when there is no such connection (it closed).

    Args:
        peer: the connecting socket's address, as ``accept`` gave it.
        local: the accepted socket's own address.

    Returns:
        The uid of the process that made the connecting socket, or ``None``.
    """
    for table, six in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
        try:
            with open(table) as f:
                text = f.read()
        except OSError:
            continue
        at = text.find(f" {_hex(peer, six)} {_hex(local, six)} {ESTABLISHED} ")
        if at >= 0:
            line = text[at:text.find("\n", at)].split()
            with contextlib.suppress(IndexError, ValueError):
                return int(line[6])
    return None


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Gate:
    """A loopback TCP port that lets in the connections of this process's user only, each
    carried to a store listener that only the gate can reach (see the module's docstring).

    Raises:
        OSError: no port pair could be bound.
    """

    def __init__(self) -> None:
        self._outer, self._inner = self._bind()
        self.port = int(self._outer.getsockname()[1])
        self._uid = os.geteuid()
        self._lock = threading.Lock()
        self._pending: set[int] = set()  # source ports let through the store's filter
        self._open: set[socket.socket] = set()
        self._refused: set[int] = set()
        self._closed = False
        self._inner_fd, self._inner_ino = -1, os.fstat(self._inner.fileno()).st_ino
        self._thread = threading.Thread(target=self._serve, name=f"shoal-store-gate-{self.port}",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _bind() -> tuple[socket.socket, socket.socket]:
        """The gate's listener on ``127.0.0.1:PORT`` and the store's, filtered to let nothing
        in yet, on ``127.0.0.2:PORT``: another port when someone holds that one."""
        for _ in range(64):
            outer = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            inner = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                outer.bind((OUTER_HOST, 0))
                attach_filter(inner, port_filter(()))
                inner.bind((INNER_HOST, outer.getsockname()[1]))
                inner.listen(socket.SOMAXCONN)
                outer.listen(socket.SOMAXCONN)
                return outer, inner
            except OSError as exc:
                outer.close()
                inner.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
        raise OSError(errno.EADDRINUSE, "no free port pair for the job's store")

    def listener_fd(self) -> int:
        """Hand the store's listening socket over (once).

        Returns:
            Its descriptor, for ``TCPStore(master_listen_fd=...)``: the store closes it.
        """
        self._inner_fd = self._inner.detach()
        return self._inner_fd

    def close(self) -> None:
        """Stop taking connections and end every carried one; the threads end with them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            carried = list(self._open)
        _shut(self._outer)  # wakes the accepting thread, which closes it
        for sock in carried:
            _shut(sock)
        if self._inner_fd < 0:
            self._inner.close()  # never handed over

    def _serve(self) -> None:
        """Accept connections until :meth:`close`; each is vetted and carried on a thread."""
        try:
            while True:
                try:
                    conn, peer = self._outer.accept()
                except OSError:  # closed; else out of descriptors or memory for now
                    if self._closed:
                        return
                    time.sleep(0.05)
                    continue
                if self._closed:
                    conn.close()
                    return
                threading.Thread(target=self._admit, args=(conn, peer), daemon=True,
                                 name=f"shoal-store-gate-{self.port}-conn").start()
        finally:
            self._outer.close()

    def _admit(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        """Carry ``conn`` (from ``peer``) to the store when its user is this process's;
        close it otherwise."""
        uid = owner_uid(peer, conn.getsockname())
        if uid != self._uid:  # another user's, or gone already
            conn.close()
            if uid is not None and self._first_refusal(uid):
                log.warning(refused_line(uid))
            return
        up = self._connect()
        if up is None:
            conn.close()
            return
        try:
            self._carry(conn, up)
        finally:
            with self._lock:
                self._open.difference_update((conn, up))
            conn.close()
            up.close()

    def _first_refusal(self, uid: int) -> bool:
        """Whether no connection of user ``uid`` was refused before."""
        with self._lock:
            first = uid not in self._refused
            self._refused.add(uid)
            return first

    def _connect(self) -> socket.socket | None:
        """A connection of the gate's own to the store (``None``: the gate closed, the store
        is gone, or too many connections are being made at once)."""
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        port = -1
        try:
            up.bind((OUTER_HOST, 0))  # no SO_REUSEADDR: nobody else can bind it meanwhile
            port = int(up.getsockname()[1])
            if not self._let_in(port):
                up.close()
                return None
            up.connect((INNER_HOST, self.port))
            # Now that the connection holds the port, its TIME_WAIT (a minute after it ends)
            # need not keep a server that reuses addresses (a TCPStore) from binding it.
            up.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except OSError:
            self._let_out(port)
            up.close()
            return None
        return up

    def _let_in(self, port: int) -> bool:
        """Let ``port`` through the store's filter (``False``: it cannot be)."""
        with self._lock:
            if self._closed or len(self._pending) >= MOST_PENDING:
                return False
            self._pending.add(port)
            if self._refilter():
                return True
            self._pending.discard(port)  # the store is gone
            return False

    def _let_out(self, port: int) -> None:
        """Take ``port`` out of the store's filter again."""
        with self._lock:
            if port in self._pending:
                self._pending.discard(port)
                self._refilter()

    def _refilter(self) -> bool:
        """Attach the filter of the pending ports to the store's listener, through a
        duplicate of its descriptor checked to be that socket (the store may have closed it
        and the number been reused); ``False``: it is gone. Called holding the lock."""
        try:
            mine = os.dup(self._inner_fd if self._inner_fd >= 0 else self._inner.fileno())
        except OSError:
            return False
        try:
            if os.fstat(mine).st_ino != self._inner_ino:
                return False
            sock = socket.socket(fileno=mine)
            try:
                attach_filter(sock, port_filter(sorted(self._pending)))
            finally:
                sock.detach()
            return True
        except OSError:
            return False
        finally:
            os.close(mine)

    def _carry(self, conn: socket.socket, up: socket.socket) -> None:
        """Copy bytes both ways between ``conn`` and ``up`` until either side ends (or the
        gate closes). The store's first answer shows that its side of ``up`` exists, with its
        copy of the filter: ``up``'s port then leaves the listener's."""
        port = int(up.getsockname()[1])
        with self._lock:
            closed = self._closed
            self._open.update(() if closed else (conn, up))
        try:
            if closed:
                return
            for sock in (conn, up):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ends = {conn.fileno(): (conn, up), up.fileno(): (up, conn)}
            buffer = bytearray(CHUNK)
            view = memoryview(buffer)
            poller = select.poll()
            for sock in (conn, up):
                poller.register(sock, select.POLLIN)
            while True:
                for fd, _ in poller.poll():
                    source, sink = ends[fd]
                    size = source.recv_into(buffer)
                    if not size:
                        return
                    sink.sendall(view[:size])
                    if source is up and port >= 0:
                        self._let_out(port)
                        port = -1
        except OSError:
            return
        finally:
            self._let_out(port)
