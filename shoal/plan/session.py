"""Several planning trials in one set of worker processes (Omnivore's short trials without a
job start-up each).

A trial job pays for its processes' start-up (importing torch, joining the job, loading the
data: 5-30 s, on an emulated cluster most of a short trial) before its first step. A
*planning session* starts the workers once and runs one trial after another in them: the
planner (:class:`PlanningSession`, in its own process) is the controller of a
:class:`~shoal.core.pool.Pool` whose workers are the session's ranks
(:mod:`shoal.plan.worker`). The first command hands them the session's base settings (they
load its data), each next one a trial's; every rank answers each with ``null`` or its
error's line. Closing the session's links ends it.

The ranks are started as a job by the sweep's launcher (locally, or under torchrun across
the emulated cluster's hosts), so the planner is not their parent: they join it through a
Unix socket in a fresh owner-only folder (a :class:`~shoal.core.pool.Listener`, closed once
they are in), and every message either way is sealed under a secret the planner makes per
session and hands to the workers in their environment. A command that the planner did not
send is refused, so nobody can make the workers run a model or write an output of theirs.

A failing trial (a diverging one, for instance) ends the session as it would end its own
job (the ranks abort together); the planner starts a new session for the next trial. A
session also ends when the planner's process is gone (its links close) or no command
arrives for the workers' idle timeout, so it never outlives the planner.

Only trials that keep the session's layout (its workers and threads) and are synchronous
strategies run in a session; the others (another process layout, an asynchronous strategy
with its parameter servers) run as jobs of their own.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.pool import Listener, Pool, WorkerLost
from shoal.core.trust import SEAL_KEY_VAR, Seal, private_dir
from shoal.errors import ShoalError


class PlanningSession:
    """A set of ``workers`` worker processes (started by ``launcher``: locally, or across an
    emulated cluster) that runs trials of ``base``'s layout one after another; each session
    started gets a fresh folder in ``directory`` (its job's ``out``). Started by the first
    :meth:`run`; :meth:`close` ends it. ``timeout`` (seconds) bounds its start and each
    trial."""

    def __init__(self, launcher: Any, base: TrainConfig, workers: int, directory: Path,
                 timeout: float) -> None:
        self.launcher, self.base, self.workers = launcher, base, workers
        self.root, self.timeout = directory, timeout
        self._count = 0  # sessions started (each in a folder of its own)
        self.dir = directory
        self.pool: Pool | None = None  # the running session's workers
        self._listener: Listener | None = None
        self._thread: threading.Thread | None = None
        self._failure: str | None = None  # the job's own failure line

    def run(self, cfg: TrainConfig) -> float:
        """Run one trial with the settings ``cfg`` (its ``out`` is the trial's directory);
        returns the session start-up it waited for (0 when one was running). A failed
        trial raises :class:`ShoalError` with its line, and the session is over."""
        startup = 0.0 if self.pool is not None else self._start()
        self._ask({"train": cfg.to_dict()}, "the trial")
        return startup

    def _start(self) -> float:
        """Start a session; returns its start-up time (until its workers loaded the data)."""
        started = time.monotonic()
        self._count += 1
        private_dir(self.root, "the planning sessions' folder")
        # New, owner-only and unpredictable: nothing of anyone else's can be there.
        self.dir = Path(tempfile.mkdtemp(prefix=f"session-{self._count}-", dir=self.root))
        seal = Seal()  # its secret reaches the workers in their environment only
        self._listener = Listener(seal)
        self._failure = None
        ended, ends = mp.Pipe(duplex=False)  # ``ended`` sees the job's end
        program = ["-m", "shoal.plan.worker", self._listener.address]

        def job() -> None:
            try:
                self.launcher.job(program, self.workers, self.workers, self.dir,
                                  f"planning session {self._count}",
                                  secrets={SEAL_KEY_VAR: seal.key_hex})
            except ShoalError as exc:
                self._failure = str(exc)
            finally:
                ends.close()

        self._thread = threading.Thread(target=job, name="shoal-plan-session", daemon=True)
        self._thread.start()
        try:
            self.pool = self._listener.accept(range(self.workers), self.timeout, ended=[ended])
        except WorkerLost as lost:
            self._fail(lost, "starting")
        except BaseException:
            self.close()
            raise
        finally:
            ended.close()
            self._close_listener()  # every worker is in: nothing listens from here on
        self._ask({"load": self.base.to_dict()}, "starting")
        return time.monotonic() - started

    def _ask(self, command: dict[str, Any], what: str) -> None:
        """Send ``command`` to every worker and wait for each one's answer; a failure ends
        the session and raises its line."""
        assert self.pool is not None
        try:
            self.pool.send_all(json.dumps(command).encode())
            got, lost = self.pool.gather(self.timeout)
        except WorkerLost as exc:
            got, lost = {}, exc
        errors = [json.loads(got[rank]).get("error") for rank in sorted(got)]
        error = next((str(e) for e in errors if e is not None), None)
        if error is not None or lost is not None:
            self._fail(lost, what, error)

    def _fail(self, lost: WorkerLost | None, what: str, error: str | None = None) -> None:
        """End the session and raise why it failed: a worker's error line, else the job's
        own failure, else what the pool saw (``lost``)."""
        self.close()
        if error is None:
            assert lost is not None
            error = self._failure or (
                f"the planning session did not finish {what} in {self.timeout:.0f} s"
                if lost.timed_out else f"the planning session ended while {what} (rank {lost.rank} "
                                       f"{lost.why})")
        raise ShoalError(error)

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def close(self) -> None:
        """End the running session: its workers see their links close and leave."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self._close_listener()
        if self._thread is not None:
            self._thread.join(30.0)
            self._thread = None
