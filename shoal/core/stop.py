"""Stopping at a safe point: SIGTERM (as Slurm sends before preemption) asks a process to
finish its step, checkpoint and stop; :func:`stop_requested` is how its loops ask."""

from __future__ import annotations

import signal
import threading
from typing import Any


class Flag:
    """A flag a signal handler may raise. ``threading.Event.set`` takes a lock: a second
    SIGTERM arriving while the first one's handler holds it (a SIGTERM to the whole job
    reaches a worker twice, directly and passed on by its launcher) runs the handler again in
    the same thread, which then waits for that lock forever."""

    def __init__(self) -> None:
        self._up = False

    def set(self) -> None:
        self._up = True

    def is_set(self) -> bool:
        return self._up

    def clear(self) -> None:
        self._up = False


STOP = Flag()  # SIGTERM arrived: finish the step, checkpoint, stop
LEAVE = Flag()  # SIGTERM to a joined worker (``shoal join``): leave the job, which goes on


def stop_requested() -> bool:
    """Whether this process was asked to stop (SIGTERM, as Slurm sends before preemption)."""
    return STOP.is_set()


def request_stop() -> None:
    """Ask this process to stop as :func:`stop_requested` reports (what SIGTERM does)."""
    STOP.set()


def stop_on_sigterm() -> Any:
    """From now on SIGTERM asks this process to stop at the next safe point instead of
    killing it: training finishes its step, writes a checkpoint and exits. Returns the
    handler it replaced (for ``signal.signal``); does nothing off the main thread."""
    return _raise_on_sigterm(STOP)


def leave_requested() -> bool:
    """Whether this worker was asked to leave a job that goes on without it (SIGTERM to
    ``shoal join``: :func:`leave_on_sigterm`)."""
    return LEAVE.is_set()


def request_leave() -> None:
    """Ask this worker to leave the job at its next meeting, as :func:`leave_on_sigterm`'s
    SIGTERM does (a worker started again at ``--resume`` only to hand its work over)."""
    LEAVE.set()


def leave_on_sigterm() -> Any:
    """From now on SIGTERM asks this worker to leave the job at its next meeting (the
    others go on; a whole job stops on its launcher's SIGTERM). Returns the handler it
    replaced; does nothing off the main thread."""
    return _raise_on_sigterm(LEAVE)


def _raise_on_sigterm(flag: Flag) -> Any:
    """SIGTERM raises ``flag`` from now on (the main thread only): the handler replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda signum, frame: flag.set())


class Leaving(Exception):
    """This worker leaves the job after step ``step``, at its own request (SIGTERM to
    ``shoal join``: :func:`leave_on_sigterm`; :func:`request_leave`); the job goes on
    without it."""

    def __init__(self, step: int, why: str = "left as the --resume on fewer workers asked"
                 ) -> None:
        super().__init__(f"left the job after step {step}")
        self.step, self.why = step, why
