"""The watcher of a parallel session: a thread that waits on the workers' process sentinels
for the whole session. When a worker dies during a call it kills the other workers (which
releases rank 0 from any Gloo collective: its peers' connections close) and, when the call
runs on the main thread, wakes it with a signal whose handler raises :class:`Interrupted`
inside rank 0's share, so the caller learns of the death at once instead of when its own
share ends."""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import signal
import threading
import time
from typing import Any

from shoal.parallel.context import in_function

# The signal the watcher sends the main thread when a worker dies mid-call: a real-time one,
# which nothing else uses (its default action would end the process, so its handler is
# installed once and left in place; it does nothing outside an interrupted call).
_WAKE = signal.SIGRTMAX - 3 if hasattr(signal, "SIGRTMAX") else signal.SIGUSR2


class Interrupted(BaseException):
    """Raised inside rank 0's share when a worker died during the call (never escapes a call:
    it becomes the :class:`WorkerError` naming that worker). A BaseException, so that a
    function's ``except Exception`` does not swallow it."""


_ARMED: Watcher | None = None  # the running watcher, whose wake-up the handler serves


def _on_wake(signum: int, frame: Any) -> None:
    watcher = _ARMED
    if watcher is not None and watcher._wake_pending and in_function():
        watcher._wake_pending = False
        raise Interrupted


def _wake_handler_ready() -> bool:
    """Whether this thread can be woken: it is the main thread and the wake-up handler is
    installed (here, the first time, unless the program handles that signal itself)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        handler = signal.getsignal(_WAKE)
        if handler == signal.SIG_DFL:
            signal.signal(_WAKE, _on_wake)
            handler = _on_wake
    except (ValueError, OSError):
        return False
    return handler is _on_wake


class Watcher:
    """Watches ``procs`` (the workers, rank ``i + 1`` at index ``i``; the list may still grow
    until :meth:`start`). Its state is guarded by a lock: the first dead workers seen (rank ->
    exit code, taken before anyone kills the rest) and the thread inside a call, if any."""

    def __init__(self, procs: list[Any]) -> None:
        self._procs = procs
        self._lock = threading.Lock()
        self._dead: dict[int, int] | None = None
        self._call_thread: int | None = None
        self._wake_ok = False  # the calling thread can be woken by a signal
        self._wake_pending = False
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_r, self._stop_w = -1, -1

    def start(self) -> None:
        global _ARMED
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="shoal-watcher", daemon=True)
        _ARMED = self
        self._thread.start()

    def stop(self) -> None:
        """End the thread (also from the thread itself, which then just returns)."""
        global _ARMED
        if _ARMED is self:
            _ARMED = None
        if self._thread is None:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        os.close(self._stop_r)
        os.close(self._stop_w)
        self._thread = None

    def _watch(self) -> None:
        """Wait for a worker to die; during a call, stop the rest and interrupt rank 0."""
        sentinels = [p.sentinel for p in self._procs]
        while not self._stopping:
            ready = multiprocessing.connection.wait([self._stop_r, *sentinels], timeout=5.0)
            if self._stop_r in ready or not ready:
                continue
            with self._lock:
                if self._deaths() is None:
                    continue  # exit code not readable yet (another thread is reaping it)
                if self._call_thread is not None:
                    for p in self._procs:  # closes rank 0's connections: no collective waits on
                        if p.exitcode is None:
                            p.kill()
                    if self._wake_ok:
                        self._wake_pending = True
                        signal.pthread_kill(self._call_thread, _WAKE)
            return  # one death breaks the session; the rest is the caller's to handle

    def _deaths(self) -> dict[int, int] | None:
        """The first dead workers (rank -> exit code); recorded the first time any is seen,
        before the others are killed. Called with ``_lock`` held."""
        if self._dead is None:
            dead = {r: p.exitcode for r, p in enumerate(self._procs, start=1) if p.exitcode is not None}
            self._dead = dead or None
        return self._dead

    def deaths(self, wait: float = 0.0) -> dict[int, int] | None:
        """The first dead workers, waiting up to ``wait`` seconds for one to show."""
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                dead = self._deaths()
            if dead is not None or time.monotonic() >= deadline:
                return dead
            multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout=0.1)

    def begin_call(self) -> bool:
        """Enter a call: from here until :meth:`end_call` a dead worker interrupts it. False
        when a worker died between calls (the call must not start)."""
        wake = _wake_handler_ready()
        with self._lock:
            if self._dead is not None:  # recorded by the thread between calls
                return False
            self._call_thread = threading.get_ident()
            self._wake_ok = wake
        return True

    def end_call(self) -> None:
        with self._lock:
            self._call_thread = None
            self._wake_ok = self._wake_pending = False

    def check_alive(self) -> None:
        """Before each slice of rank 0's share: stop if a worker died meanwhile."""
        if self._dead is not None:
            self._wake_pending = False
            raise Interrupted
