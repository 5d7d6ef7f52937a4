"""The job's store, authenticated: every key blinded, every value sealed, none replayed.

torch's ``TCPStore`` lets anyone who reaches its port read and write every key. A
:class:`SealedStore` wraps the TCPStore client at the base, below every ``PrefixStore``, so
shoal's keys, torch's process-group rendezvous over them and Gloo's groups re-formed from
them all go through it, and no call site changes:

- a key's *name* in the TCPStore is an HMAC of its logical name under the job's secret
  (:func:`SealedStore.name`). The TCPStore cannot list its keys, so an outsider can neither
  read nor address any of shoal's, ``add`` counters included (which cannot be sealed: the
  server does their arithmetic);
- a *value* is stored as ``MAGIC + tag + nonce + value``, the tag an HMAC of the logical key,
  the nonce and the value. A value that does not verify (written by someone without the
  secret, or written for another key) is ignored and reported once per key
  (:func:`forged_line`, through :mod:`logging`, by the first process of the job that meets
  it); a read waits on for a sealed one, up to the
  store's timeout, so the job goes on;
- a value this process saw superseded for its key is a *replay*: ignored the same way
  (:class:`Seen`, shared by every client of the store in this process).

torch drops the Python half of a Python store that only C++ still holds (a ``PrefixStore``
over a store made inline), so every client this module makes is kept for the life of the
process (:data:`_CLIENTS`); the store a launcher serves is its caller's to keep and drop.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from datetime import timedelta

import torch.distributed as dist

from shoal.core.trust import Seal

log = logging.getLogger("shoal.store")

#: What a sealed value starts with (a forged one rarely does, and never verifies).
MAGIC = b"\x00shoal-sealed-1\x00"
NONCE_BYTES, TAG_BYTES = 16, 32
#: A blinded name is this many bytes of an HMAC (hex in the store).
NAME_BYTES = 16
#: Seconds between two looks at a key that holds a value which does not verify.
POLL_S = 0.05
#: Keys whose accepted tags are remembered (the least recently read forgotten first), and tags
#: remembered per key.
REMEMBERED_KEYS, REMEMBERED_TAGS = 1 << 16, 16
#: Where the job counts the processes that met a forged value of a key (under its name).
REPORTED = "\0reported"
#: Clients made here, kept alive (see the module's docstring).
_CLIENTS: list[SealedStore] = []


def forged_line(key: str) -> str:
    """The one line that reports a value of ``key`` that does not verify."""
    return f"shoal: ignored an unauthenticated write to {key} from outside the job"


def _bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Seen:
    """What this process accepted of each key (its values' tags, newest last) and the keys
    whose forged values it met: a value superseded by a newer one is a replay."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tags: OrderedDict[str, list[bytes]] = OrderedDict()
        self._reported: set[str] = set()

    def accept(self, key: str, tag: bytes) -> bool:
        """Whether a value of ``key`` with ``tag`` is the newest seen (recorded so if new);
        ``False``: a replay of one superseded."""
        with self._lock:
            tags = self._tags.pop(key, [])
            self._tags[key] = tags
            if tags and tags[-1] == tag:
                return True
            if tag in tags:
                return False
            tags.append(tag)
            del tags[:-REMEMBERED_TAGS]
            while len(self._tags) > REMEMBERED_KEYS:
                self._tags.popitem(last=False)
            return True

    def first(self, key: str) -> bool:
        """Whether this is the first value of ``key`` ignored in this process."""
        with self._lock:
            if key in self._reported:
                return False
            self._reported.add(key)
            return True


class SealedStore(dist.Store):
    """A TCPStore client (or server) whose keys are blinded and values sealed with
    ``secret``; ``seen``: shared with the other clients of the same store in this process.

    Args:
        inner: the TCPStore, as torch made it.
        secret: the job's secret (16 bytes at least).
        seen: what this process accepted so far (a new record when ``None``).
    """

    def __init__(self, inner: dist.TCPStore, secret: bytes, seen: Seen | None = None) -> None:
        super().__init__()
        if len(secret) < 16:
            raise ValueError("a store's secret has 16 bytes at least")
        self._inner, self._secret = inner, secret
        self._names = Seal(hmac.new(secret, b"shoal store names", hashlib.sha256).digest())
        self._values = Seal(hmac.new(secret, b"shoal store values", hashlib.sha256).digest())
        self._seen = seen if seen is not None else Seen()
        dist.Store.set_timeout(self, inner.timeout)

    @property
    def host(self) -> str:
        return str(self._inner.host)

    @property
    def port(self) -> int:
        return int(self._inner.port)

    @property
    def secret_hex(self) -> str:
        """The secret, for the processes of the job this store serves (never shown)."""
        return self._secret.hex()

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout

    def client(self, timeout: float | None = None) -> SealedStore:
        """A new client of the same store with the same secret (its calls never queue behind
        this one's); ``timeout``: its calls' bound in seconds (this store's when ``None``)."""
        bound = self.timeout if timeout is None else timedelta(seconds=timeout)
        inner = dist.TCPStore(self.host, self.port, None, False, timeout=bound,
                              wait_for_workers=False)
        return kept(SealedStore(inner, self._secret, self._seen))

    def clone(self) -> SealedStore:
        """:meth:`client` with this store's timeout (torch's name for it)."""
        return self.client()

    def name(self, key: str) -> str:
        """The blinded name of ``key`` in the TCPStore."""
        return "s/" + self._names.tag(b"name\0", key.encode())[:NAME_BYTES].hex()

    def _sealed(self, key: str, value: bytes) -> tuple[bytes, bytes]:
        nonce = secrets.token_bytes(NONCE_BYTES)
        tag = self._values.tag(key.encode(), b"\0", nonce, value)
        return MAGIC + tag + nonce + value, tag

    def _open(self, key: str, raw: bytes) -> bytes | None:
        """The value sealed in ``raw`` for ``key``, or ``None`` when there is none: ``raw`` is
        empty (see :meth:`_read`), or it does not verify or replays one superseded (those
        two are reported)."""
        if not raw:
            return None
        head = len(MAGIC) + TAG_BYTES
        if raw.startswith(MAGIC) and len(raw) >= head + NONCE_BYTES:
            tag, body = raw[len(MAGIC):head], raw[head:]
            if self._values.check(tag, key.encode(), b"\0", body[:NONCE_BYTES],
                                  body[NONCE_BYTES:]) and self._seen.accept(key, tag):
                return body[NONCE_BYTES:]
        self._report(key)
        return None

    def _report(self, key: str) -> None:
        """Say once per job that a value of ``key`` was ignored: the first process of the job
        to meet one (a counter in the store) says it."""
        if not self._seen.first(key):
            return
        try:
            first = self._inner.add(self.name(f"{REPORTED}/{key}"), 1) == 1
        except RuntimeError:  # the store is going away: say it here
            first = True
        if first:
            log.warning(forged_line(key))

    def _peek(self, name: str) -> bytes | None:
        """What the TCPStore holds under ``name`` now (``None``: nothing), without waiting: a
        compare-and-set that never matches answers the value, or the probe when absent."""
        probe = secrets.token_bytes(NONCE_BYTES)
        raw = bytes(self._inner.compare_set(name, probe, probe))
        return None if raw == probe else raw

    def _read(self, key: str, deadline: float) -> bytes:
        """``key``'s sealed value, waiting for one (until ``deadline``, monotonic).

        torch's get waits for the key, then answers an empty value when the key is not
        there after all: its store wakes the waiters of a key on every compare-and-set of
        it, a failed one on a missing key too (:meth:`check`'s probe), and a key may be
        deleted between the wait and the read. Empty is then "not there yet": waited for
        again, never taken for a value (a meeting's decision read empty was a failed
        meeting to one member and a good one to the others)."""
        name = self.name(key)
        while True:
            value = self._open(key, bytes(self._inner.get(name)))
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"no sealed value of {key} came before the store's "
                                          "timeout (only values written from outside the job)")
            time.sleep(POLL_S)

    def _deadline(self, timeout: timedelta | None = None) -> float:
        return time.monotonic() + (timeout or self.timeout).total_seconds()

    def set(self, key: str, value: str | bytes) -> None:
        raw, tag = self._sealed(key, _bytes(value))
        self._inner.set(self.name(key), raw)
        self._seen.accept(key, tag)

    def get(self, key: str) -> bytes:
        return self._read(key, self._deadline())

    def add(self, key: str, value: int) -> int:
        return int(self._inner.add(self.name(key), value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """torch's compare-and-set on sealed values: ``desired`` is set when the sealed value
        is ``expected`` (or there is none and ``expected`` is empty; a value that does not
        verify counts as none); returns the value the key holds after it."""
        name, expected, desired = self.name(key), _bytes(expected), _bytes(desired)
        sealed, tag = self._sealed(key, desired)
        # A vote (nothing expected) tries first as if the key were absent: one round trip.
        raw = None if expected else bytes(self._inner.compare_set(name, b"", sealed))
        if raw == sealed:
            self._seen.accept(key, tag)
            return desired
        while True:
            raw = self._peek(name) if raw is None else raw
            current = None if raw is None else self._open(key, raw)
            if current is None and expected:
                return expected  # as torch answers for a key that is not there
            if current is not None and current != expected:
                return current
            if bytes(self._inner.compare_set(name, raw or b"", sealed)) == sealed:
                self._seen.accept(key, tag)
                return desired
            raw = None

    def check(self, keys: list[str]) -> bool:
        for key in keys:  # torch's check first: a probe of a missing key wakes its waiters
            name = self.name(key)
            if not self._inner.check([name]):
                return False
            raw = self._peek(name)  # the value it checks
            if raw is None or self._open(key, raw) is None:
                return False
        return True

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = self._deadline(timeout)
        for key in keys:
            name = self.name(key)
            while True:  # torch's wait may end with the key not there (see _read)
                left = max(deadline - time.monotonic(), 0.001)
                try:
                    self._inner.wait([name], timedelta(seconds=left))
                except dist.DistStoreError:  # torch's timeout: the key never came, unless a
                    if self._peek(name) is None:  # forged value is there (torch's wait, given
                        raise  # the deadline's last ms, may time out before it answers)
                raw = self._peek(name)
                if raw is not None and self._open(key, raw) is not None:
                    break
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"no sealed value of {key} came within the wait's "
                                              "timeout (only values written from outside the job)")
                time.sleep(POLL_S)

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(self.name(key)))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    # torch calls these two by their C++ names from a PrefixStore over this one.
    deleteKey = delete_key
    getNumKeys = num_keys

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)
        dist.Store.set_timeout(self, timeout)


def kept(store: SealedStore) -> SealedStore:
    """``store``, kept for the life of this process (see the module's docstring)."""
    _CLIENTS.append(store)
    return store
