"""Where the time goes: named spans grouped into categories.

Every phase of a training step (``data``, ``compute``, ``comm``, ``optim``, ...) runs inside
a :meth:`Timeline.span`. Totals are *exclusive*: a span nested in another moves its time from
the parent's category to its own, so the categories add up to the wall time of the outermost
spans. With ``keep_events`` the spans are also kept, for a Chrome/Perfetto trace.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Event:
    """One finished span, times in seconds since the timeline's origin."""

    cat: str
    name: str
    start: float
    end: float
    thread: int = 0


class Timeline:
    """Accumulates exclusive seconds per category; optionally keeps every span."""

    def __init__(self, keep_events: bool = False) -> None:
        self.origin = time.perf_counter()
        self.keep_events = keep_events
        self.events: list[Event] = []
        self.totals: dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._sync = None  # set to torch.cuda.synchronize when timing GPU work

    def set_synchronize(self, fn) -> None:  # noqa: ANN001 - a zero-argument callable
        """Call ``fn`` (e.g. ``torch.cuda.synchronize``) at span boundaries for honest GPU times."""
        self._sync = fn

    def now(self) -> float:
        return time.perf_counter()

    def _stack(self) -> list[list]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @contextmanager
    def span(self, cat: str, name: str | None = None) -> Iterator[None]:
        """Time the body as ``cat`` (exclusive of spans nested inside it)."""
        if self._sync is not None:
            self._sync()
        stack = self._stack()
        frame = [cat, 0.0]  # category, seconds claimed by children
        stack.append(frame)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            end = time.perf_counter()
            stack.pop()
            self.totals[cat] += (end - start) - frame[1]
            if stack:
                stack[-1][1] += end - start
            if self.keep_events:
                self._keep(cat, name or cat, start, end)

    def record(self, cat: str, name: str, start: float, end: float) -> None:
        """Add a span measured elsewhere (``perf_counter`` times) inside the open span.

        Its time moves from the enclosing span's category to ``cat``; used e.g. for the part
        of DDP's allreduce that backward had to wait for.
        """
        if end <= start:
            return
        stack = self._stack()
        self.totals[cat] += end - start
        if stack:
            stack[-1][1] += end - start
        if self.keep_events:
            self._keep(cat, name, start, end)

    def _keep(self, cat: str, name: str, start: float, end: float) -> None:
        self.events.append(
            Event(cat, name, start - self.origin, end - self.origin, threading.get_ident())
        )

    def snapshot(self) -> dict[str, float]:
        """A copy of the totals, for differences between two points in time."""
        return dict(self.totals)

    @staticmethod
    def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
        return {k: v - before.get(k, 0.0) for k, v in after.items()}
