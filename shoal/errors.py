"""Errors a user can act on.

A :class:`ShoalError` is printed as one line (``shoal: error: ...``) and the command exits
non-zero; any other exception is a bug in shoal or in user code and shows its traceback
only with ``--debug``.
"""

from __future__ import annotations


class ShoalError(Exception):
    """A problem the user can fix: bad argument, missing file, diverged training, ..."""

    #: Whether the user is the one to fix it (exit status 2); ``False``: the job failed
    #: (a process died, a job left without workers), exit status 1.
    user_error: bool = True


class JobError(ShoalError):
    """The job failed, not the user's input (every worker of an asynchronous job was lost):
    one line all the same, and the failure's exit status (1)."""

    user_error = False


class WorkerError(ShoalError):
    """A worker process failed; carries its rank and, when known, its traceback.

    ``exit_code``: the process's exit status (negative: the signal) when it died without
    reporting an error; ``who``: how the line names the process (default ``rank N``)."""

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
