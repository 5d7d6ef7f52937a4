"""Where the time goes: named spans grouped into categories, and the arithmetic on them.

The categories (:data:`CATEGORIES`) are defined here and nowhere else. Every phase of a
training step, and of a parallel function's call, runs inside a :meth:`Timeline.span` of
one of them; strategies only say "this is communication" (``span(COMM)``). Totals are
*exclusive*: a span nested in another moves its time from the parent's category to its
own, so the categories add up to the wall time of the outermost spans. With
``keep_events`` the spans are also kept, for a Chrome/Perfetto trace (:func:`chrome_trace`):
one lane per rank, one ``X`` event per span.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

DATA = "data"  #: reading and moving the batch
COMPUTE = "compute"  #: forward and backward
COMM = "comm"  #: collectives: sending, receiving, reducing
WAIT = "wait"  #: waiting for a slower rank (measured where a strategy can tell it apart)
OPTIM = "optim"  #: the optimizer's step and the strategy's local updates
OTHER = "other"  #: the loop's own bookkeeping
#: Where a step's time goes; exclusive, so they add up to the step's wall time.
CATEGORIES = (DATA, COMPUTE, COMM, WAIT, OPTIM, OTHER)
#: Spans outside the steps (not part of a step's time).
EVAL, CHECKPOINT = "eval", "checkpoint"


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
        # The wall clock at ``origin``: puts every rank's events on one time axis (exact on
        # one machine, as good as the clocks' synchronization across machines).
        self.origin_wall = time.time()
        self.keep_events = keep_events
        self.events: list[Event] = []
        self.totals: dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._sync = None  # set to torch.cuda.synchronize when timing GPU work

    def set_synchronize(self, fn: Callable[[], Any] | None) -> None:
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

    def leaf(self, cat: str, name: str, done: Callable[[], None] | None = None) -> _Leaf:
        """Like :meth:`span` for a body inside which nothing else is booked, at a fraction
        of its cost (no generator, no stack frame of its own): for phases on a hot path,
        such as those of every parallel function call. ``done`` is called after a body that
        did not raise."""
        return _Leaf(self, cat, name, done)

    def record(self, cat: str, name: str, start: float, end: float) -> Event | None:
        """Add a span measured elsewhere (``perf_counter`` times) inside the open span.

        Its time moves from the enclosing span's category to ``cat``; used e.g. for the part
        of DDP's allreduce that backward had to wait for. Returns the kept event, if any.
        """
        if end <= start:
            return None
        stack = self._stack()
        self.totals[cat] += end - start
        if stack:
            stack[-1][1] += end - start
        if self.keep_events:
            return self._keep(cat, name, start, end)
        return None

    def reassign(self, seconds: float, src: str, dst: str, event: Event | None = None,
                 name: str | None = None) -> None:
        """Move ``seconds`` already booked as ``src`` to ``dst``.

        For time whose nature is learnt only later: e.g. the first part of an exposed
        all-reduce turns out to have been waiting for a slower rank. With ``event`` (a kept
        span of ``src``), its first ``seconds`` become a separate ``dst`` span ``name``.
        """
        if seconds <= 0:
            return
        self.totals[src] -= seconds
        self.totals[dst] += seconds
        if event is not None:
            seconds = min(seconds, event.end - event.start)
            cut = event.start + seconds
            self.events.append(Event(dst, name or dst, event.start, cut, event.thread))
            event.start = cut

    def _keep(self, cat: str, name: str, start: float, end: float) -> Event:
        event = Event(cat, name, start - self.origin, end - self.origin, threading.get_ident())
        self.events.append(event)
        return event

    def chrome_events(self, rank: int) -> list[dict[str, Any]]:
        """The kept spans as Chrome trace ``X`` events in lane (``pid``) ``rank``.

        Times are microseconds of wall-clock time, so lanes of different ranks line up.
        Threads other than the first to record become their own rows (``tid``).
        """
        tids: dict[int, int] = {}
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
             "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
             "args": {"sort_index": rank}},
        ]
        base = self.origin_wall * 1e6
        for ev in sorted(self.events, key=lambda e: (e.start, -(e.end - e.start))):
            tid = tids.setdefault(ev.thread, len(tids))
            out.append({"name": ev.name, "cat": ev.cat, "ph": "X", "pid": rank, "tid": tid,
                        "ts": round(base + ev.start * 1e6, 3),
                        "dur": round((ev.end - ev.start) * 1e6, 3)})
        for thread, tid in tids.items():
            label = "main" if tid == 0 else f"thread {thread}"
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": label}})
        return out

    def snapshot(self) -> dict[str, float]:
        """A copy of the totals, for differences between two points in time."""
        return dict(self.totals)

    def carry_over(self, totals: dict[str, float]) -> None:
        """Add ``totals`` booked elsewhere (a resumed run's earlier time) to this timeline's."""
        for cat, seconds in totals.items():
            self.totals[cat] += seconds

    @staticmethod
    def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
        return {k: v - before.get(k, 0.0) for k, v in after.items()}


class _Leaf:
    """The context manager :meth:`Timeline.leaf` returns."""

    __slots__ = ("_timeline", "_cat", "_name", "_start", "_done")

    def __init__(self, timeline: Timeline, cat: str, name: str,
                 done: Callable[[], None] | None) -> None:
        self._timeline, self._cat, self._name, self._done = timeline, cat, name, done

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self._timeline.record(self._cat, self._name, self._start, time.perf_counter())
        if kind is None and self._done is not None:
            self._done()


def chrome_trace(lanes: Sequence[list[dict[str, Any]]], metadata: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """One Chrome trace (JSON object format) from every rank's :meth:`Timeline.chrome_events`."""
    events = [e for lane in lanes for e in lane]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}


def step_times(totals: dict[str, float]) -> dict[str, float]:
    """Only the step categories of ``totals`` (no eval, checkpoint)."""
    return {k: v for k, v in totals.items() if k in CATEGORIES}


def time_split(totals: dict[str, float]) -> dict[str, float]:
    """Seconds per step category, zeros included, rounded for logs."""
    return {k: round(totals.get(k, 0.0), 6) for k in CATEGORIES}


def time_fractions(totals: dict[str, float]) -> dict[str, float]:
    """Each step category's share of the step time."""
    step_time = sum(totals.get(k, 0.0) for k in CATEGORIES)
    return {k: round(totals.get(k, 0.0) / step_time, 6) if step_time > 0 else 0.0
            for k in CATEGORIES}


def comm_fraction(totals: dict[str, float]) -> float:
    """Communication's share of the step time (unrounded)."""
    step_time = sum(totals.get(k, 0.0) for k in CATEGORIES)
    return totals.get(COMM, 0.0) / step_time if step_time > 0 else 0.0
