"""Waiting for a word of shared memory to change: spin a few microseconds, yield the core a
while, then sleep in the kernel on a futex that the word's writer wakes.

The processes of one host that share a segment (:mod:`shoal.core.intrahost`'s sums,
:mod:`shoal.core.mailbox`'s messages) wait for each other this way. With as many processes
as cores, a wait that only spun would take the core its peer's compute needs; one that
slept at once would add a futex's wake-up (tens of microseconds) to every hand-over.
Linux on x86-64 only (the callers check): the futex is shared between processes (no
``FUTEX_PRIVATE_FLAG``), and the GIL is released while it sleeps (ctypes).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

#: How long a wait spins before it yields (seconds): a peer on a core of its own comes
#: within microseconds, and one still computing must not lose its core to the spin.
SPIN_S = 10e-6
#: Then how long it yields its core (to any process runnable there, else at once back)
#: before it sleeps: a futex's wake-up costs tens of microseconds.
YIELD_S = 200e-6
#: The futex word is the low 32 bits of a counter.
MASK = 0xFFFFFFFF

_LIBC = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE, _WAKE_ALL = 202, 0, 1, 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _timespec(seconds: float) -> object:
    return ctypes.byref(_Timespec(int(seconds), int(seconds % 1 * 1e9)))


def wake(address: int) -> None:
    """Wake every process sleeping on the 32-bit word at ``address`` (also a full memory
    barrier on this core: the kernel orders its stores before the wake)."""
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


def wait_while(same: Callable[[], bool], address: int, value: int, deadline: float,
               check: Callable[[float], None], nap: float = 0.1,
               asleep: Callable[[int], None] | None = None) -> None:
    """Return once ``same()`` is false: the word at ``address``, whose low 32 bits were
    ``value``, has changed.

    Args:
        same: Whether the word still holds what the caller saw (read from the memory).
        address: The word's address (4-byte aligned, in memory shared with its writer).
        value: Its low 32 bits when ``same()`` was last true.
        deadline: A ``time.perf_counter()`` time: ``check`` is called once it has passed.
        check: Called with the time now before each sleep: raises to end the wait (past
            the deadline, a peer gone).
        nap: The longest sleep in the kernel before ``check`` is called again (seconds).
        asleep: Called with 1 before the first sleep in the kernel (the word is read again
            after it) and with 0 once the wait ends: a flag the writer reads to skip the
            wake-up's system call while nobody sleeps.
    """
    start = time.perf_counter()
    sleep = _timespec(nap)
    slept = False
    try:
        while same():
            now = time.perf_counter()
            if now - start < SPIN_S:
                continue
            if now - start < YIELD_S:
                os.sched_yield()  # a runnable peer on this core gets it; else spin on
                continue
            check(now)
            if asleep is not None and not slept:
                asleep(1)
                slept = True
                continue
            _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, value & MASK,
                          sleep, None, 0)
    finally:
        if slept and asleep is not None:
            asleep(0)
