"""``--resume`` of an ``--elastic`` checkpoint on more or fewer workers than it holds, where
only as many can go on from it: an asynchronous job's (its servers deal each worker's
schedule), workers that drift apart between meetings inside an epoch (each resumes its own
state), PowerSGD's (each worker's error feedback). The checkpoint's workers start again and,
on more, shoal's launcher starts the others as joiners (``shoal join OUT`` in processes of
its own, which die with it): each is admitted at the first meeting point after it has loaded
the data, takes a live peer's state, and the job has the workers asked for from then on; on
fewer, the last ones leave at their first meeting, their work counted, and the others are
dealt their rest, as a lost worker's (``membership_changes`` lists the joins and leaves).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from shoal.config import TrainConfig
from shoal.core.failures import exit_status
from shoal.core.processes import start_process
from shoal.errors import ShoalError
from shoal.strategies import get_strategy
from shoal.train.checkpoint import Saved, load_checkpoint, saved_checkpoint
from shoal.train.launch import job_topology

log = logging.getLogger("shoal.train")

#: Seconds the launcher waits for its joiners once the job has ended (each finishes with the
#: job's store, its watchdog within seconds) before it stops them.
JOINERS_END_S = 30.0


def only_as_many(cfg: TrainConfig, saved: Saved) -> str | None:
    """Why the checkpoint ``saved`` of ``cfg``'s run resumes only on the workers it holds,
    as words that follow "the checkpoint holds N workers' state" (`` inside an epoch
    (easgd's workers each resume their own)``), or ``None`` where any number goes on from
    it. A restart (``_restarted``) and a resume on more or fewer (:func:`resize_at_resume`)
    ask it."""
    if job_topology(cfg, saved.ranks).detached:
        return " (an asynchronous job's servers deal each worker's schedule)"
    if cfg.strategy_options.get("compress") == "powersgd":
        return " (each worker resumes its own PowerSGD error feedback)"
    if saved.inside_epoch and not get_strategy(cfg.strategy).replicas_in_sync:
        return f" inside an epoch ({cfg.strategy}'s workers each resume their own)"
    return None


def first_joiner_id(cfg: TrainConfig) -> int | None:
    """The first joiner's worker id in a job resumed from an asynchronous ``--elastic``
    checkpoint: server 0 numbers joiners on from the checkpoint's (past every earlier
    joiner's, whose ``--record-samples`` file stays its own); ``None`` elsewhere (the
    job's first worker count)."""
    if not cfg.elastic or cfg.resume_path is None:
        return None
    try:
        payload = load_checkpoint(cfg.resume_path, mmap=True)
    except ShoalError:
        return None  # the run's own checks say why
    part = payload.get("coordinator", {}).get("elastic") or {}
    return part["next"] if isinstance(part.get("next"), int) else None


class Resize(NamedTuple):
    """How a resumed job starts (:func:`resize_at_resume`): ``cfg`` on the checkpoint's
    workers, the ``joiners`` the launcher starts with it, the workers that ``stay`` (the
    others leave at their first meeting; 0: all), the ``line`` that says so, and how many
    membership changes the checkpoint lists (``before``: the joins past them are this run's)."""

    cfg: TrainConfig
    joiners: int = 0
    stay: int = 0
    line: str = ""
    before: int = 0


def resize_at_resume(cfg: TrainConfig, given_data: bool) -> Resize:
    """The job that ``--resume --workers N`` of an ``--elastic`` checkpoint starts when the
    checkpoint goes on only on its own workers (:func:`only_as_many`) and holds another
    number: its own again, and on more the others as joiners, on fewer the last ones leaving
    at their first meeting (:func:`~shoal.core.stop.request_leave`). ``Resize(cfg)`` where
    it goes on as asked, or its own refusal says why not (data given in Python cannot be
    joined). The line is for once the run's checks passed."""
    if not cfg.elastic or cfg.resume_path is None or cfg.workers is None:
        return Resize(cfg)
    saved = saved_checkpoint(cfg.resume_path)
    if saved is None or saved.ranks == cfg.workers or (given_data and saved.ranks < cfg.workers):
        return Resize(cfg)
    why = only_as_many(cfg, saved)
    if why is None:
        return Resize(cfg)
    start = (f"shoal: the checkpoint holds {saved.ranks} workers' state{why}: {saved.ranks} "
             "start again and ")
    if saved.ranks < cfg.workers:
        more = cfg.workers - saved.ranks
        return Resize(dataclasses.replace(cfg, workers=saved.ranks,
                                          max_workers=cfg.max_workers or cfg.workers),
                      joiners=more, line=f"{start}{more} more join them (as shoal join OUT does)",
                      before=saved.changes)
    fewer = saved.ranks - cfg.workers
    its = "its" if fewer == 1 else "their"
    return Resize(dataclasses.replace(cfg, workers=saved.ranks), stay=cfg.workers,
                  line=f"{start}{fewer} of them {'leaves' if fewer == 1 else 'leave'} at {its} "
                       f"first meeting, the others dealt {its} rest")


class Joiner:
    """A joiner the launcher started; it tells the launcher its worker id, then why it did
    not join (``""`` once it finished with the job)."""

    def __init__(self, out: Path) -> None:
        self.told, told = multiprocessing.Pipe(duplex=False)
        self.process = start_process(_join, (out, told), name="shoal-resume-join")
        told.close()
        self.id: int | None = None
        self.why = ""

    def _read(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while self.told.poll(0):
                said = self.told.recv()  # its id first (an int), then why it ended
                if isinstance(said, int):
                    self.id = said
                else:
                    self.why = said

    def end(self, deadline: float, joined: set[int]) -> str:
        """Once the job has ended: wait for it up to ``deadline`` (monotonic) if it is among
        the ``joined`` ids (it finishes with the job), else stop it at once (the job went
        without it); why it did not join, ``""`` if it did."""
        self._read()
        if self.id in joined:
            self.process.join(timeout=max(0.1, deadline - time.monotonic()))
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self._read()
        if self.id not in joined:
            return self.why or "the job ended before it joined"
        code = self.process.exitcode
        return self.why or ("" if code == 0 else f"process {exit_status(code or 1)}")


def start_joiners(out: Path, count: int) -> list[Joiner]:
    """``count`` joiners of the job in ``out`` (whose job file is published), each as
    ``shoal join OUT`` runs it, in a process that dies with this one."""
    return [Joiner(out) for _ in range(count)]


def joined_since(summary: dict[str, Any] | None, before: int) -> set[int]:
    """The worker ids that joined the job whose ``summary`` it is, after the ``before``
    membership changes its checkpoint listed: an earlier run's joiner may have had an id a
    joiner has now (a synchronous job numbers its workers anew at a resume)."""
    changes = (summary or {}).get("membership_changes", [])[before:]
    return {int(w) for change in changes for w in change.get("joined", [])}


def end_joiners(joiners: list[Joiner], summary: dict[str, Any] | None, before: int = 0,
                wait_s: float = JOINERS_END_S) -> None:
    """Once the job has ended (``summary``: its summary, ``None`` if it failed): wait for
    the ``joiners`` that joined (after the checkpoint's ``before`` changes) up to ``wait_s``
    seconds in all, stop the others; say in one line each why one did not join."""
    joined = joined_since(summary, before)
    deadline = time.monotonic() + wait_s
    for joiner in joiners:
        why = joiner.end(deadline, joined)
        if why and summary is not None:
            log.warning(f"shoal: a worker started to join at --resume did not: {why}")


def _join(out: Path, told: Connection) -> None:
    """A joiner the launcher started: ``shoal join OUT``'s work; its id and how it ended go
    to the launcher (``told``), which says it once the job has ended."""
    from shoal.train.join import join_job

    try:
        code, why = join_job(out, on_id=told.send), ""
    except ShoalError as exc:
        code, why = 1, (str(exc).strip().splitlines() or [""])[0]
    with contextlib.suppress(OSError):
        told.send(why)
    sys.exit(code)


__all__ = ["Joiner", "Resize", "end_joiners", "first_joiner_id", "joined_since", "only_as_many",
           "resize_at_resume", "start_joiners"]
