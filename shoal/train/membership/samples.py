"""``--record-samples``: ``OUT/samples/worker<i>.jsonl``, the samples each worker trained,
written as they count (:mod:`~shoal.train.membership.tracker.process_group`,
:mod:`~shoal.train.membership.tracker.detached`).

A line is ``{"epoch", "samples", "step"}``: the samples of one epoch that a count carried
into the shared state, and the step the count came after. A worker writes its own lines
after the count. One lost right after a meeting counted its work (its vote was in) and
before it wrote that line leaves the line unwritten, though its work is in the model:
worker 0 then writes it for it (``"recorded_by": 0``, :func:`record_samples`'s ``by``).
Both write under an exclusive lock of the file, worker 0 only when the file's last line is
not that step's, the worker only when it is not worker 0's line for that step: each line is
written once whoever writes it (a worker that stopped answering and goes on later finds its
line written). A half line that a kill mid-write left is cut off first.

An asynchronous worker's lines say instead ``"upto"``, its schedule position after the count
(:mod:`shoal.train.membership.schedule`): server 0 writes a lost worker's samples from the file's last
``upto`` to the count it applied last (:func:`record_since`, ``"recorded_by": "server 0"``),
and the worker writes a line only past the file's last ``upto``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from shoal.config import TrainConfig
from shoal.core.trust import open_own, private_dir

log = logging.getLogger("shoal.membership")

_POLL = 0.01  # seconds between two tries of a lock held by another worker


def samples_file(cfg: TrainConfig, worker: int) -> Path | None:
    """Where ``--record-samples`` writes what worker ``worker`` trained (``None``: off)."""
    if not cfg.record_samples:
        return None
    return private_dir(Path(cfg.out) / "samples", "--record-samples' folder") / f"worker{worker}.jsonl"


def _lines(samples: dict[int, torch.Tensor], extra: dict[str, Any]) -> bytes:
    return "".join(json.dumps({"epoch": e, "samples": s.tolist(), **extra}) + "\n"
                   for e, s in samples.items() if len(s)).encode()


def record_samples(path: Path, samples: dict[int, torch.Tensor], step: int | None = None,
                   by: int | None = None, wait: float | None = None) -> bool:
    """Append to ``path`` one line per epoch of ``samples`` (epoch -> indices) counted after
    ``step`` (``None``: not said, nothing checked), in one write; ``by``: the worker that
    writes them for the file's, which is done only if the file does not end with that
    step's line (and the file's worker does not write a line that ``by`` wrote for it).
    ``wait``: the most seconds to wait for the file's lock (``None``: as long as it takes).
    Returns False when the lock was not had in time (nothing written)."""
    extra = ({} if step is None else {"step": step}) | ({} if by is None else {"recorded_by": by})
    lines = _lines(samples, extra)
    if not lines:
        return True

    def unless_written(last: dict[str, Any]) -> bytes:
        written = last.get("step") == step and (by is not None or last.get("recorded_by") is not None)
        return b"" if step is not None and written else lines

    return _append(path, unless_written, wait)


def record_since(path: Path, upto: int, since: Callable[[int], dict[int, torch.Tensor]],
                 by: str | None = None, wait: float | None = None) -> bool:
    """Append to ``path`` (an asynchronous worker's) ``since(last)``: its samples from the
    file's last ``upto`` (0: none) to ``upto``, unless the file is there already; ``by``:
    who writes them for the file's worker (``None``: the worker itself). ``wait`` and the
    result as :func:`record_samples`'s."""
    extra = {"upto": upto} | ({} if by is None else {"recorded_by": by})

    def rest(last: dict[str, Any]) -> bytes:
        done = last.get("upto")
        done = max(0, done) if isinstance(done, int) else 0  # a bound on what the file says
        return _lines(since(done), extra) if done < upto else b""

    return _append(path, rest, wait)


def cut_after(cfg: TrainConfig, step: int) -> None:
    """``--resume`` (and ``--max-restarts``' restart): drop each worker's lines of counts
    after ``step``, the checkpoint's, whose work the resumed run trains again (a file's
    lines come in the order of their steps, so the rest from the first later one goes)."""
    folder = Path(cfg.out) / "samples"
    if not cfg.record_samples or not folder.is_dir():
        return
    for path in sorted(folder.glob("worker*.jsonl")):
        _cut_from(path, lambda record: record.get("step", -1) > step)


def cut_upto(path: Path | None, upto: int) -> None:
    """An asynchronous ``--resume`` (or restart): drop the lines of ``path`` (a worker's, as
    :func:`record_since` writes them) past ``upto``, its count in the checkpoint. Its
    samples after that count are trained again, and not as before where the resume dealt
    its schedule anew (a worker back takes part of the others' rest): the file's old lines
    would name samples that another worker now trains."""
    if path is not None and path.exists():
        _cut_from(path, lambda record: isinstance(record.get("upto"), int)
                  and record["upto"] > upto)


def _cut_from(path: Path, past: Callable[[dict[str, Any]], bool]) -> None:
    """Drop ``path``'s lines from the first one that is ``past`` the point to cut at."""
    fd = open_own(path, os.O_RDWR)  # ours only: a planted file is refused
    try:
        with _locked(fd, None):
            data, at = os.pread(fd, os.fstat(fd).st_size, 0), 0
            for line in data.splitlines(keepends=True):
                if past(_record(line)):
                    os.ftruncate(fd, at)
                    break
                at += len(line)
    finally:
        os.close(fd)


def _append(path: Path, lines: Callable[[dict[str, Any]], bytes], wait: float | None) -> bool:
    """Append ``lines(last)`` to ``path`` under its exclusive lock, ``last`` its last line
    read back (``{}``: none, or not a line of ours); False when the lock was not had in
    ``wait`` seconds (nothing written)."""
    fd = open_own(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)  # read back and cut: ours only
    try:
        with _locked(fd, wait) as locked:
            if not locked:
                return False
            data = lines(_record(_last_line(fd)))
            if data:
                os.write(fd, data)
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(fd: int, wait: float | None) -> Iterator[bool]:
    """The file's exclusive lock, tried for up to ``wait`` seconds; whether it was had."""
    if wait is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    else:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(_POLL)
    try:
        yield True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _last_line(fd: int) -> bytes:
    """The file's last whole line (``b""``: none), after cutting off a half line at its end
    (a writer killed mid-write)."""
    end = pos = os.fstat(fd).st_size
    tail = b""
    while pos > 0:
        pos = max(0, pos - 4096)
        tail = os.pread(fd, end - pos - len(tail), pos) + tail
        if tail.count(b"\n") >= 2 or (pos == 0 and b"\n" in tail):
            break
    if tail and not tail.endswith(b"\n"):
        cut = tail.rfind(b"\n") + 1
        os.ftruncate(fd, end - (len(tail) - cut))
        tail = tail[:cut]
    return tail[tail.rfind(b"\n", 0, len(tail) - 1) + 1:]


def _record(line: bytes) -> dict[str, Any]:
    """A record line as a dict (``{}``: none, or not a line of ours)."""
    try:
        record = json.loads(line)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def say_held(worker: int, which: str) -> None:
    """Say that a lost ``worker``'s file was not written for it (its lock held too long)."""
    log.warning(f"shoal: worker {worker} holds its --record-samples file (stopped while writing "
                f"it?): its samples of {which} are recorded only if it goes on")
