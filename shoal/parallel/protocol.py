"""What the controller and its workers say over their pipes, and how a worker's error
travels back."""

from __future__ import annotations

import traceback

from shoal.errors import ShoalError

# Command opcodes (first element of every pickled message to a worker).
OP_CALL, OP_CLOSE = 1, 2
# Controller's verdict after the statuses came in.
GO, SKIP = b"\x01", b"\x00"


class RemoteTraceback(Exception):
    """The text of a worker's traceback, chained under the :class:`WorkerError` it caused."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]).rstrip()


def error_info(exc: BaseException) -> tuple[str, str, str, bool]:
    """A worker's exception as (type name, message, traceback text, raised by shoal)."""
    return (type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)),
            isinstance(exc, ShoalError))
