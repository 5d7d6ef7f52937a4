"""Checkpoints that are never half-written and never loaded blindly.

A checkpoint is written to a temporary file in the same directory, flushed to disk and then
renamed over the old one, so a crash at any moment leaves either the old or the new file.
It is read with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers
only, never arbitrary pickled objects.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from shoal.errors import ShoalError

FORMAT = "shoal-checkpoint"
#: How :func:`atomic_write` names its temporary files (``mkstemp`` adds 8 random characters).
TMP_PREFIX = ".shoal-tmp-"
_OWN_TEMPORARY = re.compile(re.escape(TMP_PREFIX) + r"[^/]+\.[A-Za-z0-9_]{8}\.tmp")
VERSION = 1


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` with every tensor moved to the CPU (for gathering and saving)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


#: Write errors that mean "no room": a full disk, the file-size limit, the disk quota.
_NO_SPACE = {errno.ENOSPC: "", errno.EFBIG: " (file size limit reached)",
             errno.EDQUOT: " (disk quota exceeded)"}


class _Recorder:
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
    recorder: _Recorder | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", suffix=".tmp",
                                   dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            recorder = _Recorder(f)
            write(recorder)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        error = _os_error(exc, recorder.error if recorder is not None else None)
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


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as a checkpoint at ``path`` (see :func:`atomic_write`): a full disk
    is one line, ``no space left on device writing PATH; the previous checkpoint is kept``."""
    payload = {"format": FORMAT, "version": VERSION, **payload}
    atomic_write(path, lambda f: torch.save(payload, f), what="checkpoint")


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`, or raise a one-line error."""
    if not path.is_file():
        raise ShoalError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ShoalError(f"{path} is not a readable checkpoint ({first})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ShoalError(f"{path} is not a shoal checkpoint")
    if payload.get("version") != VERSION:
        raise ShoalError(f"{path} has checkpoint version {payload.get('version')}, "
                         f"this shoal reads version {VERSION}")
    return payload


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
