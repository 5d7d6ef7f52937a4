"""An elastic job outlives its first workers: the launcher holds the job's store while the
job goes on in workers that joined it.

The store is served by shoal's launcher (:func:`~shoal.core.processes.spawn`); when every
worker it started was lost, a job whose latest group holds joiners (``shoal join OUT``)
still trains in them, and would stop with the store. So the launcher waits until each of
those members is done: its ``shoal join`` said it finished (:func:`finished_key`) or how it
ended (:func:`~shoal.core.waits.ended_key`), or its heartbeat stood still for ``timeout``
seconds (a ``shoal join`` killed with its worker says nothing). Members the others left out
drop out of the latest group by themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from shoal.core.waits import Keys, ended_key, generation_key, members_now, stood_still

POLL = 0.5  # seconds between looks
STALE = 30.0  # seconds a heartbeat (bumped about every 0.5 s) stands still: gone


def finished_key(member: int) -> str:
    """Where ``shoal join`` says that its worker ``member`` finished with the job."""
    return f"finished/{member}"


def outlive(store: Any, started: int, timeout: float, stop: Callable[[], bool]) -> None:
    """Wait while the job (``store``: its keys under the attempt's prefix) goes on in
    members with ids from ``started`` on, or until ``stop()`` (SIGTERM: the job ends with
    the store)."""
    beats: dict[int, tuple[int, float]] = {}
    while not stop():
        if not live_joiners(store, started, timeout, beats):
            return
        time.sleep(POLL)


def live_joiners(store: Any, started: int, timeout: float,
                 beats: dict[int, tuple[int, float]]) -> list[int]:
    """The members of the job's latest group with ids from ``started`` on (its joiners)
    that neither said they finished or how they ended, nor stood still for ``timeout``
    seconds (``beats``: the heartbeats seen so far, kept by the caller between looks)."""
    members = [m for m in members_now(store) or [] if m >= started]
    return [m for m in members if not store.check([finished_key(m)])
            and not store.check([ended_key(m)]) and not _still(store, m, beats, timeout)]


def _still(store: Any, member: int, beats: dict[int, tuple[int, float]], timeout: float) -> bool:
    """Whether ``member``'s heartbeat stood still for ``timeout`` seconds."""
    if not store.check([generation_key(member)]):
        return False  # not beating yet
    count = store.add(Keys(int(store.get(generation_key(member)))).heartbeat(member), 0)
    return stood_still(beats, member, count, timeout)
