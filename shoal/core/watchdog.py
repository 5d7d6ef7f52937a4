"""The watchdog every rank of a job of several processes runs on the job's store.

It ends the rank within a second when another rank reports a failure (``abort``), and names
a rank that stopped responding (no heartbeat for ``heartbeat_timeout`` seconds), left the
job or never comes to a collective (:mod:`shoal.core.waits`) instead of letting the job wait
out the collectives' timeout. See :class:`Watchdog`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from shoal.core.env import Environment
from shoal.core.failures import EXIT_ABORTED, first_line, record_for
from shoal.core.group import own_client
from shoal.core.guard import name_thread
from shoal.core.sealed import SealedStore
from shoal.core.waits import Waits, beat

log = logging.getLogger("shoal.watchdog")

ABORT_KEY = "abort"
HUNG = "stopped responding"  # how a hung rank's report begins

_T = TypeVar("_T")


class Watchdog:
    """Two daemon threads that end this process when the job cannot go on.

    The *watch* thread asks the job's store every ``tick`` seconds, over a connection of its
    own, whether a rank reported a failure (``abort``; this process then exits with
    :data:`EXIT_ABORTED`). About every second it bumps this rank's heartbeat counter, which
    also carries how many collectives this rank issued, and looks at this rank's wait
    (``waits``: a rank that left the job or never comes to the collective this one waits in
    is named). With a ``heartbeat_timeout`` it also reads the next rank's counter (a ring:
    every rank is watched by exactly one other, so the store sees a few calls a second per
    rank). A counter that did not move for ``heartbeat_timeout`` seconds means that rank
    stopped running (``kill -STOP``, swapped out, a deadlock holding the GIL). A rank that is
    only slow (computing, sleeping, waiting in a collective) keeps beating: its main thread
    is not needed for that, only the GIL now and then. Whatever rank the watchdog finds out,
    it reports under that rank's name, to the other ranks through ``abort`` and to shoal's
    launcher through the rank's failure file, and exits.

    The *guard* thread times the watch thread's store calls: a call to a host that stopped
    (rather than died) never returns, so one that is not back within ``heartbeat_timeout``
    means the store's host (shoal's launcher, the torchrun agent, or rank 0) stopped
    responding, and this process exits saying so.

    Both discount time in which this process itself did not run (a whole job stopped with
    Ctrl-Z and resumed): nobody can be judged over a time nobody was watching. With
    ``judge_peers`` False (elastic membership) it beats and watches for ``abort`` only: a
    lost peer is :mod:`shoal.core.membership`'s to handle.
    """

    def __init__(self, env: Environment, store: dist.Store, heartbeat_timeout: float | None,
                 leaving: Callable[[], bool], waits: Waits, *, judge_peers: bool = True) -> None:
        self._env = env
        self._leaving = leaving  # whether this rank itself reported a failure and is leaving
        self._rank, self._world = env.rank, env.world_size
        self._limit = heartbeat_timeout
        self._waits = waits  # this rank's collectives, and what to make of a long wait
        self._judge = judge_peers  # False (elastic): beat, but end nothing for a lost peer
        self._store = store
        if isinstance(store, (dist.TCPStore, SealedStore)):
            self._address = f"{store.host}:{store.port}"
        else:
            self._address = f"{env.master_addr}:{env.master_port}"
        self._tick = 0.5 if heartbeat_timeout is None else min(0.5, heartbeat_timeout / 6)
        # A longer gap than this between two looks means this process did not run meanwhile.
        self._gap = max(1.0, (heartbeat_timeout or 4.0) / 2)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call_since: float | None = None  # when the store call in flight began
        self._threads = [threading.Thread(target=self._watch, name="shoal-watchdog", daemon=True)]
        if heartbeat_timeout is not None:
            self._threads.append(threading.Thread(target=self._guard, name="shoal-store-guard",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float) -> None:
        """Stop both threads; wait up to ``timeout`` seconds for each."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout)

    # -- the watch thread --------------------------------------------------------------------
    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, timed by the guard thread."""
        with self._lock:
            self._call_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._call_since = None

    def _watch(self) -> None:
        name_thread(f"shoal-hb-r{self._rank}")
        try:
            self._watch_store(self._call(own_client, self._store, self._env.attempt))
        except Exception as exc:
            # The store is gone, and with it the job, unless we are shutting down normally.
            if not self._stop.wait(2.0):
                self._exit(self._lost_contact(f"{type(exc).__name__}: {first_line(exc, 200)}"))

    def _watch_store(self, store: dist.Store) -> None:
        limit = self._limit
        peer = (self._rank + 1) % self._world
        waits, keys = self._waits, self._waits.keys
        beat_every = 1.0 if limit is None else min(1.0, limit / 4)
        published = 0  # the collective count this rank's counter carries
        seen: int | None = None  # the peer's counter, and when it last changed (this clock)
        seen_at = looked_at = next_beat = time.monotonic()
        while not self._stop.wait(self._tick):
            if self._call(store.check, [ABORT_KEY]):
                reason = self._call(store.get, ABORT_KEY).decode()
                if self._leaving():
                    return  # this rank's own report, or one that crossed it: it is leaving
                self._exit(reason)
            if time.monotonic() < next_beat:
                continue
            count = waits.log.count
            self._call(store.add, keys.heartbeat(self._rank), beat(count, published))
            published = count
            now = time.monotonic()
            next_beat = now + beat_every
            if now - looked_at > self._gap:
                seen, seen_at = None, now  # this process did not run: judge nobody for it
                waits.resumed()
            looked_at = now
            if limit is not None and self._judge:
                counter = self._call(store.add, keys.heartbeat(peer), 0)  # reads (never waits)
                if counter != seen:
                    seen, seen_at = counter, now
                elif now - seen_at > limit:
                    message = f"{HUNG}: no heartbeat for {limit:g} s (hung, stopped or swapped out)"
                    self._blame(store, peer, message, "TimeoutError",
                                f"rank {peer} did not run; rank {self._rank}'s watchdog saw its "
                                "heartbeat stop")
            found = None if self._leaving() or not self._judge else waits.look(store, self._call)
            if found is not None:
                self._blame(store, *found, "", f"rank {self._rank}'s watchdog found it out "
                            "from the job's store while waiting for it")

    def _blame(self, store: dist.Store, rank: int, message: str, kind: str, why: str) -> None:
        """End the job for rank ``rank``'s sake: tell the other ranks (the first report
        stands: a rank that failed just before names the real cause) and shoal's launcher
        (``record_for``), and exit."""
        reason = first = f"rank {rank}: {message}"
        with contextlib.suppress(Exception):
            first = self._call(store.compare_set, ABORT_KEY, "", reason).decode()
        if first != reason:
            self._exit(first)
        errdir = self._env.error_dir
        if errdir:
            with contextlib.suppress(OSError):
                record_for(errdir, rank, message, kind, why)
        self._exit(reason)

    # -- the guard thread --------------------------------------------------------------------
    def _guard(self) -> None:
        assert self._limit is not None
        last = time.monotonic()
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                if self._call_since is not None and now - last > self._gap:
                    self._call_since = now  # this process was not running: start again
                waited = 0.0 if self._call_since is None else now - self._call_since
            last = now
            if waited > self._limit:
                self._exit(self._lost_contact(f"no answer for {self._limit:g} s"))

    # -- leaving -----------------------------------------------------------------------------
    def _lost_contact(self, detail: str) -> str:
        host = {"local": "shoal's launcher", "torchrun": "the torchrun agent"}.get(
            self._env.launcher, "rank 0")
        return f"lost contact with the job's store at {self._address} (served by {host}): {detail}"

    def _exit(self, reason: str) -> None:
        if self._env.error_dir is None:  # shoal's own launcher reports it
            log.error(f"shoal: rank {self._rank} stopping: {reason}")
        errfile = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if errfile:
            # torchrun's summary takes the first rank to exit for the root cause: this one
            # when it stops for another's failure. Its error file says whose it is.
            with contextlib.suppress(OSError), open(errfile, "w") as f:
                json.dump({"message": {"message": reason, "extraInfo": {
                    "py_callstack": f"rank {self._rank} stopped because {reason}",
                    "timestamp": str(int(time.time()))}}}, f)
        os._exit(EXIT_ABORTED)
