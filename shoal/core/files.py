"""Files that are never half-written: :func:`atomic_write`, and the clean-up after a kill;
output directories checked before any work (:func:`check_output_dir`,
:func:`make_output_dir`); results read back without trusting them (:func:`read_json`,
:func:`read_records`).

Every file a run writes whole (checkpoints, ``summary.json``, ``config.json``, the trace, a
trimmed ``metrics.jsonl``) goes through :func:`atomic_write`: a temporary file in the same
directory, flushed to disk and renamed over the old one, so a crash at any moment leaves
either the old or the new file. A result another process was to write may still be
missing or malformed (that process was killed, or failed): reading it is one line then.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
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


def describe_stat(st: os.stat_result) -> str:
    """``owner uid 1000, mode 0755``: who may write a file or folder."""
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _check_not_shared(path: Path, flag: str) -> None:
    """Refuse, in one line, an output folder that someone else could plant files in or swap:
    one that exists and is not this user's, or is writable by everyone, or that lies inside a
    folder writable by everyone without the sticky bit (as ``/tmp`` has). shoal reads its
    own files back from there (a checkpoint to resume, a log to go on with)."""
    path = Path(path).absolute()
    for folder in (path, *path.parents):
        try:
            st = os.stat(folder)
        except OSError:
            continue  # not made yet (shoal makes it), or not ours to judge
        if folder == path:
            if not stat.S_ISDIR(st.st_mode):
                return  # not a folder: the caller's own checks say so
            if st.st_uid != os.geteuid() or st.st_mode & 0o002:
                raise ShoalError(f"{flag} {path} is not a folder of yours that only you can write "
                                 f"({describe_stat(st)}): someone else could plant or replace the "
                                 "files shoal reads back; choose another folder")
        elif st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise ShoalError(f"{flag} {path} lies inside {folder}, which anyone can write "
                             f"({describe_stat(st)}, no sticky bit): someone else could replace "
                             "the run's folder; choose another place")


def check_output_dir(path: Path, flag: str = "--out") -> None:
    """Raise a one-line :class:`ShoalError` naming ``flag`` when ``path`` cannot become an
    output directory, creating nothing: an existing file, a path under a file, a directory
    (or, for a new one, its nearest existing parent) this process may not write in, or one
    on a read-only file system."""
    path = Path(path)
    _check_not_shared(path, flag)
    try:
        if path.exists() and not path.is_dir():
            raise ShoalError(f"{flag} {path} exists and is not a directory")
        existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
        if not existing.is_dir():
            raise ShoalError(f"{flag} {path} is under {existing}, which is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ShoalError(f"{flag} {path}: no permission to write in {existing}")
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            raise ShoalError(f"{flag} {path} is on a read-only file system")
    except OSError as exc:  # a parent it may not even look into, a name too long, ...
        raise ShoalError(f"{flag} {path}: cannot write there "
                         f"({exc.strerror or type(exc).__name__})") from None


def make_output_dir(path: Path, flag: str = "--out") -> None:
    """Create the output directory ``path`` (and its parents) and make sure a file can be
    written in it (a probe, removed at once; what a special file system such as /proc
    refuses shows only then), or raise a one-line :class:`ShoalError` naming ``flag``."""
    check_output_dir(path, flag)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f"{TMP_PREFIX}probe.", suffix=".tmp", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ShoalError(f"{flag} {path}: cannot write there "
                         f"({exc.strerror or type(exc).__name__})") from None


def read_json(path: Path, what: str) -> Any:
    """The JSON value in ``path``, or a one-line :class:`ShoalError` that names ``what`` (the
    ``summary`` of a run) when the file is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise ShoalError(f"no {what} at {path}") from None
    except (OSError, ValueError, RecursionError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ShoalError(f"the {what} {path} is not readable JSON ({reason})") from None


def read_records(path: Path, what: str) -> list[dict[str, Any]]:
    """The records of the JSON-lines file ``path`` (``metrics.jsonl``), each a mapping, or a
    one-line :class:`ShoalError` naming ``what`` and the first bad line."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        raise ShoalError(f"no {what} at {path}") from None
    except OSError as exc:
        raise ShoalError(f"the {what} {path} is not readable ({exc.strerror})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict):
            raise ShoalError(f"the {what} {path} has a malformed line {number}")
        records.append(record)
    return records
