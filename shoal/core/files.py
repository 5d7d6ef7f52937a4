"""Files that are never half-written: :func:`atomic_write`, and the clean-up after a kill.

Every file a run writes whole (checkpoints, ``summary.json``, ``config.json``, the trace, a
trimmed ``metrics.jsonl``) goes through :func:`atomic_write`: a temporary file in the same
directory, flushed to disk and renamed over the old one, so a crash at any moment leaves
either the old or the new file.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError

#: How :func:`atomic_write` names its temporary files (``mkstemp`` adds 8 random characters).
TMP_PREFIX = ".shoal-tmp-"
_OWN_TEMPORARY = re.compile(re.escape(TMP_PREFIX) + r"[^/]+\.[A-Za-z0-9_]{8}\.tmp")

#: Write errors that mean "no room": a full disk, the file-size limit, the disk quota.
_NO_SPACE = {errno.ENOSPC: "", errno.EFBIG: " (file size limit reached)",
             errno.EDQUOT: " (disk quota exceeded)"}


class _ErrorKeepingFile:
    """A file object that remembers the OSError its ``write`` raised: ``torch.save`` turns
    it into ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _os_error(exc: BaseException, recorded: OSError | None) -> OSError | None:
    """The OSError behind ``exc``: recorded by the writer, ``exc`` itself, or its cause."""
    if recorded is not None:
        return recorded
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def atomic_write(path: Path, write: Any, what: str = "file") -> None:
    """Call ``write(file_object)`` on a temporary file, fsync it, rename it to ``path``.

    A failed write (a full disk, a file-size limit or quota, no permission) removes the
    temporary, keeps any previous ``path`` and raises a one-line :class:`ShoalError` that
    says so; ``what`` names the file in it (``checkpoint``).
    """
    existed = path.exists()
    tmp: str | None = None
    keeper: _ErrorKeepingFile | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", suffix=".tmp",
                                   dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            keeper = _ErrorKeepingFile(f)
            write(keeper)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        error = _os_error(exc, keeper.error if keeper is not None else None)
        if error is None or not isinstance(exc, Exception):
            raise
        kept = (f"; the previous {what} is kept" if existed and path.exists()
                else f"; no {what} was written")
        if error.errno in _NO_SPACE:
            raise ShoalError(f"no space left on device writing {path}{_NO_SPACE[error.errno]}"
                             f"{kept}") from exc
        reason = error.strerror or type(error).__name__
        raise ShoalError(f"cannot write {path}: {reason}{kept}") from exc
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def remove_stale_temporaries(directory: Path) -> None:
    """Delete the temporary files :func:`atomic_write` left behind when killed mid-write.

    Only shoal's own names (``.shoal-tmp-<file>.<random>.tmp``, as :func:`atomic_write`
    makes them) are touched: an output directory may be a user's home or working directory,
    and their ``.something.tmp`` files are theirs.
    """
    if directory.is_dir():
        for tmp in directory.iterdir():
            if _OWN_TEMPORARY.fullmatch(tmp.name) and tmp.is_file():
                tmp.unlink(missing_ok=True)
