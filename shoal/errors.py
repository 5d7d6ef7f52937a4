"""Errors a user can act on.

A :class:`ShoalError` is printed as one line (``shoal: error: ...``) and the command exits
non-zero; any other exception is a bug in shoal or in user code and shows its traceback
only with ``--debug``.
"""

from __future__ import annotations


class ShoalError(Exception):
    """A problem the user can fix: a bad argument, a missing file, diverged training, ...

    ``shoal`` prints it as one line (``shoal: error: ...``) and exits with status 2, or 1
    where `user_error` is ``False`` (the job failed: a process died).
    """

    #: Whether the user is the one to fix it (exit status 2); ``False``: the job failed
    #: (a process died, a job left without workers), exit status 1.
    user_error: bool = True


class JobError(ShoalError):
    """The job failed, not the user's input (every worker of an asynchronous job was lost):
    one line all the same, and the failure's exit status (1)."""

    user_error = False


class WorkerError(ShoalError):
    """A worker process failed; carries its rank and, when known, its traceback.

    Raised by `shoal.launch`, `shoal.fork` and parallel calls; its message is the rank's
    name and the first line of its error.

    Args:
        rank: The failed process's rank.
        message: What happened, in one line.
        traceback: The worker's traceback, when it reported one.
        user_error: Whether the worker raised a `ShoalError` (bad input, divergence).
        exit_code: The process's exit status (negative: the signal) when it died without
            reporting an error.
        who: How the line names the process; default ``rank N``.
    """

    def __init__(self, rank: int, message: str, traceback: str = "",
                 user_error: bool = False, exit_code: int | None = None,
                 who: str | None = None) -> None:
        super().__init__(f"{who or f'rank {rank}'}: {message}")
        self.rank = rank
        self.message = message
        self.traceback = traceback
        self.user_error = user_error  # the worker raised a ShoalError (bad input, divergence)
        self.exit_code = exit_code


class Terminated(ShoalError):
    """The job was stopped by SIGTERM before it could start (``shoal`` exits with 143)."""
