"""Several planning trials in one set of worker processes (Omnivore's short trials without a
job start-up each).

A trial job pays for its processes' start-up (importing torch, joining the job, loading the
data: 5-30 s, on an emulated cluster most of a short trial) before its first step. A
*session* starts the workers once and runs one trial after another in them: the planner
(:class:`Session`, in its own process) writes each trial's run settings into the session's
directory as ``trial-K.json``; rank 0 of the workers (:func:`serve`) waits for that file and
sends the settings to every rank, each rank runs the :class:`~shoal.train.trainer.Trainer`
on the session's process group and its loaded data, and rank 0 writes ``trial-K.done``
(``{"error": null}``, or the error's line). A file ``stop`` ends the session.

The directory is made fresh and owner-only (``mkdtemp`` inside a private
``trials/sessions``), and every file either side acts on is sealed
(:class:`~shoal.core.trust.Seal`): an HMAC under a secret the planner makes per session and
hands to the workers in their environment. A trial file that the planner did not write is
refused, so nobody who can write near ``--out`` can make the workers run a model or write
an output of theirs.

A failing trial (a diverging one, for instance) ends the session as it would end its own
job (the ranks abort together); the planner starts a new session for the next trial. A
session also ends when the planner's process is gone or no trial arrives for
``idle_timeout`` seconds, so it never outlives the planner.

Only trials that keep the session's layout (its workers and threads) and are synchronous
strategies run in a session; the others (another process layout, an asynchronous strategy
with its parameter servers) run as jobs of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.failures import first_line
from shoal.core.trust import SEAL_KEY_VAR, Seal, private_dir
from shoal.errors import ShoalError

#: How often rank 0 looks for the next trial, and the planner for a trial's end (seconds).
POLL_S = 0.05
#: A session with no trial for this long ends (the planner is gone or stuck).
IDLE_TIMEOUT_S = 600.0


# -- the workers' side -----------------------------------------------------------------------
def serve(directory: Path, base: TrainConfig, parent: int, idle_timeout: float = IDLE_TIMEOUT_S,
          seal: Seal | None = None) -> None:
    """This rank's part of the session in ``directory``: join the job, load ``base``'s data,
    run the trials the planner (process ``parent``) writes and ``seal`` signed (by default
    the seal of this process's environment), until ``stop``."""
    from shoal.core.comm import init_comm
    from shoal.core.env import Environment, default_threads, detect_environment
    from shoal.core.timeline import Timeline
    from shoal.data import load_dataset
    from shoal.train.optim import resolve_momentum
    from shoal.train.trainer import Trainer, data_options

    seal = seal if seal is not None else Seal.from_environment()
    env = detect_environment() or Environment()
    threads = base.threads_per_worker or default_threads(env.local_world_size)
    comm = init_comm(env, base.device, base.timeout, threads, Timeline(),
                     heartbeat_timeout=base.heartbeat_timeout)
    try:
        data = load_dataset(base.dataset, data_options(base))
        if comm.rank == 0:
            seal.write(directory / "ready", {"pid": os.getpid()})
        k = 0
        while True:
            spec = comm.broadcast_object(
                _next_trial(directory, k, parent, idle_timeout, seal) if comm.rank == 0 else None)
            if spec is None:
                break
            try:
                cfg = resolve_momentum(TrainConfig.from_dict(spec), comm.world_size)
                Trainer(cfg, comm, data).run()
            except BaseException as exc:
                if comm.rank == 0:
                    seal.write(directory / f"trial-{k}.done", {"trial": k, "error": first_line(exc)})
                raise
            if comm.rank == 0:
                seal.write(directory / f"trial-{k}.done", {"trial": k, "error": None})
            k += 1
    except BaseException as exc:
        comm.abort(first_line(exc))
        raise
    comm.close()


def _next_trial(directory: Path, k: int, parent: int, idle_timeout: float, seal: Seal
                ) -> dict[str, Any] | None:
    """Rank 0: the settings of trial ``k`` once the planner wrote them; ``None`` to stop."""
    path, deadline = directory / f"trial-{k}.json", time.monotonic() + idle_timeout
    while not path.exists():
        if (directory / "stop").exists() or not _alive(parent) or time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    sealed = seal.read(path)
    if not isinstance(sealed, dict) or sealed.get("trial") != k or not isinstance(
            sealed.get("settings"), dict):
        raise ShoalError(f"{path} is not trial {k} of this session: refusing to act on it")
    return sealed["settings"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m shoal.plan.session DIR --parent PID [--workers N]``: under torchrun (or
    another launcher) this process is one rank; otherwise it spawns ``N`` local workers
    (one worker: this process)."""
    from shoal.core.env import detect_environment
    from shoal.core.processes import spawn

    p = argparse.ArgumentParser(prog="python -m shoal.plan.session")
    p.add_argument("directory", type=Path)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT_S)
    args = p.parse_args(argv)
    try:
        base = TrainConfig.from_dict(Seal.from_environment().read(args.directory / "base.json"))
        if detect_environment() is not None or args.workers in (None, 1):
            serve(args.directory, base, args.parent, args.idle_timeout)
        else:
            spawn(args.workers, serve, (args.directory, base, args.parent, args.idle_timeout))
    except ShoalError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 1
    return 0


# -- the planner's side ----------------------------------------------------------------------
class Session:
    """A set of ``workers`` worker processes (started by ``launcher``: locally, or across an
    emulated cluster) that runs trials of ``base``'s layout one after another, in
    ``directory``. Started by the first :meth:`run`; :meth:`close` ends it."""

    def __init__(self, launcher: Any, base: TrainConfig, workers: int, directory: Path,
                 timeout: float) -> None:
        self.launcher, self.base, self.workers = launcher, base, workers
        self.root, self.timeout = directory, timeout
        self.seal = Seal()  # its secret reaches the workers in their environment only
        self._count = 0  # sessions started (each in a directory of its own)
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self.dir = directory
        self._k = 0  # the next trial's number in the running session

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start(self) -> float:
        """Start a session; returns its start-up time (until its workers are ready)."""
        started = time.monotonic()
        self._count += 1
        private_dir(self.root, "the planning sessions' folder")
        # New, owner-only and unpredictable: nothing of anyone else's can be there.
        self.dir = Path(tempfile.mkdtemp(prefix=f"session-{self._count}-", dir=self.root))
        self.seal.write(self.dir / "base.json", self.base.to_dict())
        self._k, self._failure = 0, None
        program = ["-m", "shoal.plan.session", str(self.dir), "--parent", str(os.getpid())]

        def run() -> None:
            try:
                self.launcher.job(program, self.workers, self.workers, self.dir,
                                  f"planning session {self._count}",
                                  secrets={SEAL_KEY_VAR: self.seal.key_hex})
            except ShoalError as exc:
                self._failure = str(exc)

        self._thread = threading.Thread(target=run, name="shoal-plan-session", daemon=True)
        self._thread.start()
        self._wait(self.dir / "ready", "starting")
        self.seal.read(self.dir / "ready")  # this session's workers, nobody else's file
        return time.monotonic() - started

    def _wait(self, path: Path, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not path.exists():
            if not self.alive:
                if path.exists():  # written just before the session ended
                    return
                raise ShoalError(self._failure or f"the planning session ended while {what}")
            if time.monotonic() > deadline:
                self.close()
                raise ShoalError(f"the planning session did not finish {what} in "
                                 f"{self.timeout:.0f} s")
            time.sleep(POLL_S)

    def run(self, cfg: TrainConfig) -> float:
        """Run one trial with the settings ``cfg`` (its ``out`` is the trial's directory);
        returns the session start-up it waited for (0 when one was running). A failed
        trial raises :class:`ShoalError` with its line, and the session is over."""
        startup = 0.0 if self.alive else self._start()
        k = self._k
        self._k += 1
        self.seal.write(self.dir / f"trial-{k}.json", {"trial": k, "settings": cfg.to_dict()})
        done = self.dir / f"trial-{k}.done"
        self._wait(done, f"trial {k}")
        answer = self.seal.read(done)
        if not isinstance(answer, dict) or answer.get("trial") != k:
            self.close()
            raise ShoalError(f"{done} does not answer trial {k} of this session")
        error = answer.get("error")
        if error is not None:  # the session is over: its workers leave together
            self.close()
            raise ShoalError(str(error))
        return startup

    def _join(self, seconds: float) -> None:
        if self._thread is not None:
            self._thread.join(seconds)

    def close(self) -> None:
        """End the running session (its workers leave once they read ``stop``)."""
        if self._thread is None:
            return
        with contextlib.suppress(OSError):
            (self.dir / "stop").touch()
        self._join(30.0)
        self._thread = None


if __name__ == "__main__":
    sys.exit(main())
