"""Folders, files and messages shoal acts on later, made so that nobody else can plant or
swap them.

A folder that holds what shoal reads back (the planner's trials) is made by
:func:`private_dir`: new, owner-only, or refused in one line when it exists and is not this
user's own with a safe mode. A file read back from such a place is opened by
:func:`open_own` (never through a symbolic link, and only a file this user owns). An
instruction that crosses between processes a session did not start itself (a planning
session's commands, :mod:`shoal.core.pool`) is checked by a :class:`Seal`: an HMAC under a
secret that lives only in the memory and environment of the processes of one session, so
a message that shoal did not send, or sent for another session, is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from shoal.core.files import describe_stat
from shoal.errors import ShoalError

#: The environment variable that hands a session's or job's secret to the processes it
#: starts (an environment is readable by its owner only, unlike a command line); the same
#: one a user gives a job's ranks (:mod:`shoal.core.secret`).
SEAL_KEY_VAR = "SHOAL_SECRET"


def check_private_dir(path: Path, what: str = "folder") -> None:
    """Raise a one-line :class:`ShoalError` unless ``path`` is a real folder (not a link) of
    this user's that no one else may write into."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ShoalError(f"cannot use {what} {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ShoalError(f"{what} {path} exists and is not a folder (a link or a file): "
                         "shoal made none there; remove it or choose another --out")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ShoalError(f"{what} {path} exists and is not a private folder of yours "
                         f"({describe_stat(st)}): someone else could plant files in it; remove it "
                         "or choose another --out")


def private_dir(path: Path, what: str = "folder") -> Path:
    """``path`` as a folder only this user can enter: made now with mode 0700 (its parents
    as usual), or, when it exists, checked to be this user's own and writable by no one
    else (else a one-line :class:`ShoalError`). Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ShoalError(f"cannot make {what} {path}: {exc.strerror}") from None
    check_private_dir(path, what)
    return path


def open_own(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """``os.open(path, flags)`` that never follows a symbolic link and, for a file that was
    there already, accepts it only when this user owns it. Returns the descriptor."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError:
        if os.path.islink(path):
            raise ShoalError(f"{path} is a symbolic link; shoal does not write or read "
                             "through links it did not make: remove it") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ShoalError(f"{path} is not a file of yours ({describe_stat(st)}): shoal did not "
                         "write it; remove it or choose another --out")
    return fd


class Seal:
    """Signs messages and checks them back (HMAC-SHA256 under a random secret).

    One seal per session: the controller makes it (``Seal()``), hands :attr:`key_hex` to the
    processes it starts through their environment (:data:`SEAL_KEY_VAR`), and they rebuild
    it with :meth:`from_environment`.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)

    @property
    def key_hex(self) -> str:
        return self._key.hex()

    @classmethod
    def from_environment(cls) -> Seal:
        """The seal whose secret this process's starter put in :data:`SEAL_KEY_VAR`."""
        value = os.environ.get(SEAL_KEY_VAR, "")
        try:
            key = bytes.fromhex(value)
        except ValueError:
            key = b""
        if len(key) < 16:
            raise ShoalError(f"no session secret in {SEAL_KEY_VAR}: this process must be started "
                             "by the shoal process that owns the session")
        return cls(key)

    def tag(self, *parts: bytes) -> bytes:
        """The signature (32 bytes) of ``parts`` taken one after another."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def check(self, tag: bytes, *parts: bytes) -> bool:
        """Whether ``tag`` is this seal's :meth:`tag` of ``parts`` (in constant time)."""
        return hmac.compare_digest(self.tag(*parts), tag)
