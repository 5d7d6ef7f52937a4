"""Errors a user can act on.

A :class:`ShoalError` is printed as one line (``shoal: error: ...``) and the command exits
non-zero; any other exception is a bug in shoal or in user code and shows its traceback
only with ``--debug``.
"""

from __future__ import annotations


class ShoalError(Exception):
    """A problem the user can fix: bad argument, missing file, diverged training, ..."""


class WorkerError(ShoalError):
    """A worker process failed; carries its rank and, when known, its traceback."""

    def __init__(self, rank: int, message: str, traceback: str = "",
                 user_error: bool = False) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.traceback = traceback
        self.user_error = user_error  # the worker raised a ShoalError (bad input, divergence)


class Terminated(ShoalError):
    """The job was stopped by SIGTERM before it could start (``shoal`` exits with 143)."""
