"""A controller hands work to a set of started workers: one command to every worker, then
every worker's answer, or the first worker lost.

A :class:`Pool` holds one *link* per worker rank (an object with ``send_bytes``,
``recv_bytes`` and ``fileno``). Links come two ways, used the same way afterwards
(:meth:`Pool.send_all`, :meth:`Pool.gather`, :meth:`Pool.recv_all`):

- :meth:`Pool.start` starts local workers itself (:func:`~shoal.core.processes.start_process`)
  with a pipe each: a message costs tens of microseconds, and a worker's process sentinel
  shows its death at once (the sessions of parallel functions);
- a :class:`Listener` takes workers that something else started, whose controller is not
  their parent (a job's own launcher, torchrun on the emulated cluster's hosts): each
  connects to the controller's socket (:func:`join_pool`). That socket is a Unix socket in a
  fresh owner-only folder, which the processes of every network namespace of this machine
  (the emulated hosts) reach and no other user does, or ``HOST:PORT`` for workers on other
  machines. A worker proves that it holds the session's secret (a
  :class:`~shoal.core.trust.Seal`) by signing the controller's fresh nonce with its rank,
  and every message either way is sealed over the link's nonce, its direction and its
  number (:class:`SealedLink`): a message this session did not send, or sent earlier, on
  another link or the other way, is refused.

Every wait is a blocking ``multiprocessing.connection.wait`` with a timeout: nothing polls.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any

from shoal.core.failures import first_line
from shoal.core.processes import start_process, stop_processes
from shoal.core.trust import Seal
from shoal.errors import ShoalError

log = logging.getLogger("shoal.pool")

#: Seconds a new connection has to prove that it comes from a worker of this session.
HELLO_S = 10.0
_TAG = 32  # bytes of a seal's signature
_TO_WORKER, _TO_CONTROLLER = b"c", b"w"


class WorkerLost(Exception):
    """A worker of a pool is gone or silent: its ``rank``, ``why`` (a few words: "closed its
    link", "did not answer within 5 s"), and whether the wait ``timed_out``."""

    def __init__(self, rank: int, why: str, timed_out: bool = False) -> None:
        super().__init__(f"worker {rank} {why}")
        self.rank, self.why, self.timed_out = rank, why, timed_out


class Pool:
    """The controller's links to its workers, by rank (in rank order), and the processes of
    those it started itself."""

    def __init__(self) -> None:
        self.links: dict[int, Any] = {}
        self.procs: list[BaseProcess] = []  # the local workers, in rank order
        self._sentinels: dict[int, int] = {}  # rank -> its process's sentinel

    def start(self, target: Callable[..., None], ranks: Iterable[int], args: tuple[Any, ...],
              name: str) -> None:
        """Start ``target(link, rank, *args)`` in a local process for each of ``ranks``,
        ``link`` being the worker's end of its pipe. Each joins the pool as it starts, so
        that :meth:`stop` ends those started when a later start fails."""
        for rank in ranks:
            ours, theirs = mp.Pipe()
            try:
                process = start_process(target, (theirs, rank, *args), name=f"{name}-{rank}")
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self.add(rank, ours, process)

    def add(self, rank: int, link: Any, process: BaseProcess | None = None) -> None:
        """Take ``link`` as rank ``rank``'s (ranks come in order), with its ``process`` when
        it is a local one."""
        self.links[rank] = link
        if process is not None:
            self.procs.append(process)
            self._sentinels[rank] = process.sentinel

    def send_all(self, message: bytes) -> None:
        """``message`` to every worker; a worker whose link is closed raises
        :class:`WorkerLost` once the others have it."""
        lost = None
        for rank, link in self.links.items():
            try:
                link.send_bytes(message)
            except OSError:
                lost = lost or WorkerLost(rank, "closed its link")
        if lost is not None:
            raise lost

    def gather(self, timeout: float, fail_fast: bool = True) -> tuple[dict[int, bytes], WorkerLost | None]:
        """One message from each worker, until all have answered or ``timeout`` seconds
        passed, or (``fail_fast``) one is lost: its link closed, its process ended, or it
        sent what its link refuses. Returns the answers by rank and the first loss (``None``
        when every worker answered)."""
        got: dict[int, bytes] = {}
        first: WorkerLost | None = None
        waiting = {link: rank for rank, link in self.links.items()}
        deadline = time.monotonic() + timeout
        while waiting and not (first is not None and fail_fast):
            left = deadline - time.monotonic()
            if left <= 0:
                late = min(waiting.values())
                return got, first or WorkerLost(late, f"did not answer within {timeout:g} s", True)
            watched = {self._sentinels[r]: r for r in waiting.values() if r in self._sentinels}
            ready = mp.connection.wait([*waiting, *watched], timeout=left)
            for obj in ready:  # answers first: one sent just before its process ended counts
                rank = waiting.pop(obj, None) if not isinstance(obj, int) else None
                if rank is not None:
                    try:
                        got[rank] = obj.recv_bytes()
                    except (EOFError, OSError):
                        first = first or WorkerLost(rank, "closed its link")
                    except ShoalError as exc:
                        first = first or WorkerLost(rank, first_line(exc))
            for rank in (watched[obj] for obj in ready if isinstance(obj, int)):
                if waiting.pop(self.links[rank], None) is not None:
                    first = first or WorkerLost(rank, "ended")
        return got, first

    def recv_all(self, timeout: float) -> list[bytes]:
        """One message from every worker, in rank order; the first worker lost (or silent
        for ``timeout`` seconds) raises :class:`WorkerLost` at once."""
        got, lost = self.gather(timeout)
        if lost is not None:
            raise lost
        return [got[rank] for rank in self.links]

    def close(self) -> None:
        """Close every link: a worker waiting for a command sees its end."""
        for link in self.links.values():
            link.close()

    def stop(self, grace: float) -> None:
        """Give the local workers ``grace`` seconds to exit, stop the rest (SIGTERM, then
        SIGKILL), and close every link."""
        try:
            stop_processes(self.procs, grace)
        finally:
            self.close()


class SealedLink:
    """A socket between the controller and one worker on which every message is sealed: its
    signature covers the link's nonce, its direction and its number, so a message counts
    only once, in its order, on this link and going its way."""

    def __init__(self, conn: mp.connection.Connection, seal: Seal, nonce: bytes, controller: bool) -> None:
        self._conn, self._seal, self._nonce = conn, seal, nonce
        self._out, self._in = (_TO_WORKER, _TO_CONTROLLER) if controller else (_TO_CONTROLLER, _TO_WORKER)
        self._sent = self._received = 0

    def fileno(self) -> int:
        return self._conn.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message (or the link's end) is there within ``timeout`` seconds."""
        return self._conn.poll(timeout)

    def send_bytes(self, data: bytes) -> None:
        head = self._out + self._sent.to_bytes(8, "big")
        self._conn.send_bytes(self._seal.tag(self._nonce, head, data) + data)
        self._sent += 1

    def recv_bytes(self) -> bytes:
        """The next message; a one-line :class:`ShoalError` when its seal does not match,
        ``EOFError`` when the other side closed the link."""
        message = self._conn.recv_bytes()
        tag, data = message[:_TAG], message[_TAG:]
        head = self._in + self._received.to_bytes(8, "big")
        if not self._seal.check(tag, self._nonce, head, data):
            raise ShoalError("a message on the session's link was not sent by this shoal session "
                             "(its signature does not match): refusing to act on it")
        self._received += 1
        return data

    def close(self) -> None:
        self._conn.close()


def _socket_address(address: str) -> tuple[socket.AddressFamily, Any]:
    """A Unix socket's path (it holds a ``/``), or ``HOST:PORT``: its family and address."""
    if "/" in address:
        return socket.AF_UNIX, address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ShoalError(f"a worker pool's address is a socket's path or HOST:PORT, not {address!r}")
    return socket.AF_INET, (host, int(port))


class Listener:
    """Where workers that something else started join their controller (see the module's
    docstring). ``address``: by default a Unix socket in a fresh owner-only folder of the
    temp folder (removed by :meth:`close`); or ``HOST:PORT`` (port 0: any free one) for
    workers on other machines. :attr:`address` is what they :func:`join_pool`."""

    def __init__(self, seal: Seal, address: str | None = None) -> None:
        self._seal = seal
        self._folder = None if address is not None else tempfile.mkdtemp(prefix="shoal-pool-")
        self.address = address or os.path.join(self._folder or "", "socket")
        family, where = _socket_address(self.address)
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock.bind(where)
            self._sock.listen(socket.SOMAXCONN)
        except OSError as exc:
            self.close()
            raise ShoalError(f"cannot listen for workers at {self.address}: {exc.strerror or exc}") from None
        self._sock.setblocking(False)
        if family == socket.AF_INET:
            self.address = f"{where[0]}:{self._sock.getsockname()[1]}"

    def accept(self, ranks: Iterable[int], timeout: float, ended: Iterable[Any] = ()) -> Pool:
        """The pool of the workers ``ranks`` once each has joined. A connection that does not
        prove itself within :data:`HELLO_S` seconds, or names a rank not expected or taken,
        is closed and changes nothing. :class:`WorkerLost` (the first rank missing) when
        ``timeout`` seconds pass first, or one of ``ended`` (objects to wait on: the job's
        end) is ready."""
        expected, joined = set(ranks), Pool()
        pending: dict[mp.connection.Connection, tuple[bytes, float]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(joined.links) < len(expected):
                missing = min(expected - joined.links.keys())
                now = time.monotonic()
                if now >= deadline:
                    raise WorkerLost(missing, f"did not join within {timeout:g} s", True)
                wake = min([deadline, *(due for _, due in pending.values())])
                ready = mp.connection.wait([self._sock, *pending, *ended], timeout=wake - now)
                if any(obj in ready for obj in ended):
                    raise WorkerLost(missing, "ended before it joined")
                if self._sock in ready:
                    self._take(pending)
                for conn in [c for c in pending if c in ready or pending[c][1] <= time.monotonic()]:
                    nonce, _ = pending.pop(conn)
                    self._hello(conn, nonce, expected, joined)
        except BaseException:
            joined.close()
            raise
        finally:
            for conn in pending:
                conn.close()
        pool = Pool()
        for rank in sorted(joined.links):
            pool.add(rank, joined.links[rank])
        return pool

    def _take(self, pending: dict[mp.connection.Connection, tuple[bytes, float]]) -> None:
        """Accept a connection and send it a fresh nonce to sign."""
        try:
            sock, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        sock.setblocking(True)
        conn = mp.connection.Connection(sock.detach())
        nonce = secrets.token_bytes(16)
        try:
            conn.send_bytes(nonce)
        except OSError:
            conn.close()
            return
        pending[conn] = (nonce, time.monotonic() + HELLO_S)

    def _hello(self, conn: mp.connection.Connection, nonce: bytes, expected: set[int], joined: Pool) -> None:
        """Add ``conn`` to ``joined`` when it signed ``nonce`` as a rank still missing."""
        try:
            message = conn.recv_bytes(maxlength=4 + _TAG) if conn.poll(0) else b""
        except (EOFError, OSError):
            message = b""
        mine, tag = message[:4], message[4:]
        rank = int.from_bytes(mine, "big")
        if (len(message) == 4 + _TAG and rank in expected and rank not in joined.links
                and self._seal.check(tag, b"hello", nonce, mine)):
            joined.add(rank, SealedLink(conn, self._seal, nonce, controller=True))
            return
        conn.close()
        log.warning(f"shoal: warning: refused a connection to {self.address} that did not prove it "
                    "comes from a worker of this session")

    def close(self) -> None:
        """Stop listening; remove the socket's folder."""
        if self._sock is not None:
            self._sock.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def join_pool(address: str, rank: int, seal: Seal, timeout: float) -> SealedLink:
    """A worker's side: connect to the controller's :class:`Listener` at ``address`` as
    ``rank``, signing its nonce with ``seal``; the link to receive commands on and answer.
    One-line :class:`ShoalError` when the controller cannot be reached in ``timeout`` s."""
    family, where = _socket_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(where)
        sock.setblocking(True)
    except OSError as exc:
        sock.close()
        raise ShoalError(f"cannot reach the controller at {address}: {exc.strerror or exc}") from None
    conn = mp.connection.Connection(sock.detach())
    try:
        if not conn.poll(timeout):
            raise ShoalError(f"the controller at {address} did not answer within {timeout:g} s")
        nonce = conn.recv_bytes(maxlength=64)
        mine = rank.to_bytes(4, "big")
        conn.send_bytes(mine + seal.tag(b"hello", nonce, mine))
    except (EOFError, OSError):
        conn.close()
        raise ShoalError(f"the controller at {address} closed the connection") from None
    except BaseException:
        conn.close()
        raise
    return SealedLink(conn, seal, nonce, controller=False)
