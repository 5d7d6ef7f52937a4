"""How many processes and threads this machine can hold.

Every count that becomes local processes (``--workers``, ``--servers``, ``--loader-workers``,
``shoal run --workers``, ``shoal.launch(workers=)``, ``shoal.fork(n)``) is checked here
before the first process starts, so a mistyped count is one line and nothing started, not
a machine swapping or out of process slots. The bounds come from the machine:

- memory: what is available now (``MemAvailable``, or less under a cgroup v2
  ``memory.max``) over what one process needs, :data:`PROCESS_BYTES` for a spawned
  interpreter and :data:`FORKED_BYTES` for a forked DataLoader process;
- tasks: a user's processes and threads are counted together against ``RLIMIT_NPROC``
  (not for root), and a cgroup's against ``pids.max``; a spawned process runs its
  intra-op threads and :data:`TASKS_PER_PROCESS` more.

Intra-op threads per process are at most the machine's logical CPUs (more only take turns).
"""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

from shoal.errors import ShoalError

#: Memory one spawned process (a fresh interpreter with torch) is counted at. Measured on
#: CPU: a worker training a small model with Gloo has about 50 MB of memory of its own
#: (torch's shared libraries, about 220 MB, are shared by all); the rest is room for its
#: model, optimizer state and batches. A job whose model is large needs more than this.
PROCESS_BYTES = 128 << 20
#: Memory one forked DataLoader process is counted at (it shares its worker's pages until
#: either writes them: about 20 MB of its own measured).
FORKED_BYTES = 32 << 20
#: Threads a spawned process runs besides its intra-op threads (Gloo's, the store
#: client's, shoal's watchdog and heartbeat; 10 measured), and a forked loader process.
TASKS_PER_PROCESS = 12
TASKS_PER_FORKED = 4


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**40 else f"{n / 2**40:.1f} TiB"


def _cgroup_file(name: str) -> int | None:
    """A number in this process's cgroup v2 directory (``None``: no such file, or ``max``)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.startswith("0::"))
        text = (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / name).read_text().strip()
        return None if text == "max" else int(text)
    return None


def available_memory() -> int | None:
    """Bytes of memory new processes can have now (``None`` where the system does not say)."""
    free = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                    if ln.startswith("MemAvailable:"))
        free = int(line.split()[1]) * 1024
    if free is None:
        with contextlib.suppress(ValueError, OSError, AttributeError):
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit, used = _cgroup_file("memory.max"), _cgroup_file("memory.current")
    if limit is not None and used is not None:
        free = max(0, limit - used) if free is None else min(free, max(0, limit - used))
    return free


def _user_tasks(uid: int) -> int:
    """Threads of every process of user ``uid`` (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(entry / "task"))
    return count


def task_room() -> tuple[int, str] | None:
    """How many more tasks (processes and threads) may start, and which limit says so;
    ``None`` when no limit applies."""
    rooms = []
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and Path("/proc").is_dir():
        rooms.append((soft - _user_tasks(os.getuid()), f"RLIMIT_NPROC {soft}"))
    limit, used = _cgroup_file("pids.max"), _cgroup_file("pids.current")
    if limit is not None and used is not None:
        rooms.append((limit - used, f"the cgroup's pids.max {limit}"))
    return min(rooms) if rooms else None


def check_memory(what: str, need: int) -> None:
    """Raise :class:`ShoalError` unless ``need`` bytes of memory are available for ``what``."""
    memory = available_memory()
    if memory is not None and need > memory:
        raise ShoalError(f"{what} need {_gib(need)} of memory; this machine has {_gib(memory)} "
                         "available")


def check_processes(what: str, processes: int, forked: int = 0, threads: int = 1) -> None:
    """Raise :class:`ShoalError` (naming ``what``, e.g. ``--workers 500``) unless this
    machine can hold ``processes`` more spawned processes of ``threads`` intra-op threads
    each, and ``forked`` more forked loader processes."""
    count = f"{processes} processes" + (f" and {forked} loader processes" if forked else "")
    memory = available_memory()
    need = processes * PROCESS_BYTES + forked * FORKED_BYTES
    if memory is not None and need > memory:
        each = (f"{PROCESS_BYTES >> 20} MiB a process, {FORKED_BYTES >> 20} MiB a loader "
                "process") if forked else f"{PROCESS_BYTES >> 20} MiB each"
        most = "" if forked else f" (at most {memory // PROCESS_BYTES} processes)"
        raise ShoalError(f"{what}: {count} need {_gib(need)} of memory ({each}); this machine "
                         f"has {_gib(memory)} available{most}")
    room = task_room()
    tasks = processes * (threads + TASKS_PER_PROCESS) + forked * TASKS_PER_FORKED
    if room is not None and tasks > room[0]:
        raise ShoalError(f"{what}: {count} run about {tasks} threads ({threads} intra-op and "
                         f"{TASKS_PER_PROCESS} more each); only {max(0, room[0])} more may start "
                         f"here ({room[1]})")


def cpu_bound() -> tuple[int, str]:
    """The most intra-op threads a process may ask for, and why (the ``at_most`` of a
    setting, see :mod:`shoal.schema`)."""
    return os.cpu_count() or 1, "this machine's logical CPUs; more only take turns"


def check_threads(what: str, threads: int | None) -> None:
    """Raise :class:`ShoalError` unless ``threads`` (``None``: the default) intra-op threads
    per process are at most this machine's logical CPUs."""
    most, why = cpu_bound()
    if threads is not None and threads > most:
        raise ShoalError(f"{what} must be at most {most} ({why}), got {threads}")
