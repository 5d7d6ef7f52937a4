"""Whether this thread runs a parallel function's body, and the books it keeps meanwhile.

Inside a function the collectives are the SPMD kind (every rank calls them at once) and
book their time and bytes on the rank's :class:`Meter`; outside, on the controller, they
act on the workers' replicas. A worker is inside a function for its whole life.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

from shoal.core.timeline import Timeline


class Meter:
    """One rank's books for parallel calls: where the time went (a core
    :class:`~shoal.core.timeline.Timeline`, spans kept for a trace when asked) and how many
    bytes of tensors this rank sent (a scatter or broadcast counts at its source, a reduce
    or gather at every rank but the destination, an all-reduce or all-gather everywhere)."""

    def __init__(self, keep_events: bool = False) -> None:
        self.timeline = Timeline(keep_events=keep_events)
        self.bytes_sent = 0

    def span(self, cat: str, name: str | None = None) -> AbstractContextManager[None]:
        """Time the body as ``cat``; spans booked inside it take their time out of it."""
        return self.timeline.span(cat, name)

    def leaf(self, cat: str, name: str) -> AbstractContextManager[None]:
        """Time the body as ``cat``, where nothing else is booked inside it (cheap: for the
        few phases of every call)."""
        return self.timeline.leaf(cat, name)

    def count(self, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)


_state = threading.local()
_OUTSIDE: tuple[bool, Meter | None] = (False, None)


def in_function() -> bool:
    """True while this process runs a parallel function's body (every rank at once)."""
    return getattr(_state, "inside", False)


def enter_function(meter: Meter | None) -> tuple[bool, Meter | None]:
    """Mark this thread as running a function's body, booking on ``meter``; returns the
    state to :func:`restore` afterwards."""
    previous = (in_function(), getattr(_state, "meter", None))
    _state.inside, _state.meter = True, meter
    return previous


def restore(previous: tuple[bool, Meter | None]) -> None:
    """Put back the state :func:`enter_function` returned."""
    _state.inside, _state.meter = previous


def leave_function() -> None:
    """Mark this thread as outside any function: the controller after a call that failed,
    where an interruption may have come before the body's own :func:`restore`."""
    restore(_OUTSIDE)


def booked(cat: str, name: str, nbytes: int = 0) -> AbstractContextManager[None]:
    """A span of ``cat`` on the running function's meter (and ``nbytes`` sent), or nothing
    outside a metered function (a serial call)."""
    meter = getattr(_state, "meter", None)
    if meter is None:
        return nullcontext()
    meter.count(nbytes)
    return meter.leaf(cat, name)
