"""Checkpoints that are never half-written and never loaded blindly.

A checkpoint is written to a temporary file in the same directory, flushed to disk and then
renamed over the old one, so a crash at any moment leaves either the old or the new file.
It is read with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers
only, never arbitrary pickled objects.
"""

from __future__ import annotations

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


def atomic_write(path: Path, write: Any) -> None:
    """Call ``write(file_object)`` on a temporary file, fsync it, rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    payload = {"format": FORMAT, "version": VERSION, **payload}
    atomic_write(path, lambda f: torch.save(payload, f))


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
