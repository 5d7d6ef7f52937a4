"""A real CPU throttle for a set of processes: a cgroup (v1 ``cpu`` controller) of shoal's own.

The emulated cluster's slow hosts (``--emulate-slow HOST:FRACTION``) run in a :class:`CpuLimit`:
a cgroup made fresh under ``/sys/fs/cgroup/cpu`` with a name carrying the run's id, whose
``cpu.cfs_quota_us`` lets its processes use ``FRACTION`` of one core per ``cfs_period_us``
(the kernel stops them for the rest of each period, whatever they do: nothing in shoal's loop
sleeps). Processes are moved in by pid (their children are born inside); removing the
cgroup kills what is left in it (only processes shoal put there) and deletes it, on every
exit path of its owner. :func:`cleanup` removes the cgroups a killed run left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from shoal.errors import ShoalError

#: Where the cgroup v1 ``cpu`` controller is mounted.
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
#: The kernel's smallest quota (1 ms) in a 100 ms period.
MIN_FRACTION = 0.01


def can_throttle() -> str | None:
    """``None`` when CPU throttles can be made here; otherwise why not (one line)."""
    if not sys.platform.startswith("linux"):
        return "CPU throttles (cgroups) need Linux"
    if os.geteuid() != 0:
        return "throttling a host's CPU (a cgroup of the cpu controller) needs root"
    if not (CPU_ROOT / "cpu.cfs_quota_us").is_file():
        return f"no cgroup v1 cpu controller at {CPU_ROOT} (cpu.cfs_quota_us is missing)"
    return None


def check_fraction(fraction: float, what: str) -> float:
    """``fraction`` of one core, checked: in (0, 1] and at least :data:`MIN_FRACTION`."""
    if not MIN_FRACTION <= fraction <= 1:
        raise ShoalError(f"{what}: the fraction of a core must be in (0, 1] and at least "
                         f"{MIN_FRACTION:g} (the kernel's 1 ms quota), got {fraction:g}")
    return fraction


class CpuLimit:
    """The cgroup ``CPU_ROOT/name`` holding its processes to ``fraction`` of one core.

    :meth:`create` makes it (refusing a name that exists: shoal acts only on its own);
    :meth:`add` moves a process in by pid; :meth:`remove` empties and deletes it.
    """

    def __init__(self, name: str, fraction: float) -> None:
        if "/" in name or name.startswith("."):
            raise ShoalError(f"bad cgroup name {name!r}")
        self.name, self.fraction = name, check_fraction(fraction, name)
        self.path = CPU_ROOT / name
        self._made = False

    def create(self) -> CpuLimit:
        why = can_throttle()
        if why is not None:
            raise ShoalError(f"cannot throttle a host: {why}")
        try:
            os.mkdir(self.path, 0o755)  # fails if it exists: never one we did not make
        except OSError as exc:
            raise ShoalError(f"cannot make cgroup {self.path}: {exc.strerror}") from None
        self._made = True
        try:
            self._write("cpu.cfs_period_us", PERIOD_US)
            self._write("cpu.cfs_quota_us", max(1000, round(self.fraction * PERIOD_US)))
        except BaseException:
            self.remove()
            raise
        return self

    def _write(self, name: str, value: int) -> None:
        try:
            (self.path / name).write_text(f"{value}\n")
        except OSError as exc:
            raise ShoalError(f"cannot write {value} to {self.path / name}: {exc.strerror}") from None

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and so the children it starts from now on) into the cgroup."""
        self._write("cgroup.procs", pid)

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        with contextlib.suppress(OSError):
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        return []

    def remove(self, timeout: float = 10.0) -> None:
        """Kill what is still inside (processes shoal put there) and delete the cgroup."""
        if self._made:
            _remove(self.path, timeout)
            self._made = False


def _remove(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:  # busy: killed processes not gone yet
            if time.monotonic() > deadline:
                raise ShoalError(f"cannot remove cgroup {path}: {exc.strerror}") from None
            time.sleep(0.05)


def cleanup(prefix: str) -> list[str]:
    """Empty and delete every cgroup of the cpu controller whose name starts with ``prefix``
    (what a killed run left behind); return their names."""
    if not prefix or not CPU_ROOT.is_dir():
        return []
    found = sorted(p for p in CPU_ROOT.iterdir() if p.name.startswith(prefix) and p.is_dir())
    for path in found:
        _remove(path, 10.0)
    return [p.name for p in found]
