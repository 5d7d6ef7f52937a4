"""Where this process sits in a job: rank, world size, the job's address, its device and
its threads.

A job is either started by shoal itself (``--workers N`` spawns N local processes; each gets
its :class:`Environment` as an object) or by an outside launcher that already started one
process per rank: torchrun, Accelerate, Ray Train (``RANK`` ...), Lightning (``LOCAL_RANK``,
``NODE_RANK``), Slurm's ``srun`` (``SLURM_PROCID`` ...) or mpirun (OpenMPI's
``OMPI_COMM_WORLD_*``, MPICH/Hydra's ``PMI_*``, MVAPICH2's ``MV2_*``), read by
:func:`detect_environment` (each launcher's variables: :mod:`shoal.core.launchers`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

from shoal.core.guard import die_with_launcher
from shoal.core.launchers import read_launcher
from shoal.core.place import Environment
from shoal.errors import ShoalError

if TYPE_CHECKING:
    import torch


def detect_environment(env: Mapping[str, str] | None = None) -> Environment | None:
    """The job this process belongs to, if a launcher started it; else ``None``.

    A process shoal's own launcher started gets its :class:`Environment` handed over as an
    object (:func:`set_environment`). Otherwise the variables are read
    (:func:`~shoal.core.launchers.read_launcher`): torchrun's (and Accelerate's, Ray
    Train's), Slurm's, an MPI launcher's, Lightning's.

    Raises:
        ShoalError: A launcher's variables that are not numbers, or that name a job of
            several processes without this process's rank in it (never a job of one).
    """
    if env is None:
        if _GIVEN is not None:
            return _GIVEN
        env = os.environ
    return read_launcher(env)


def rank_environment() -> Environment | None:
    """:func:`detect_environment`, for a process about to act as a rank of the job it
    finds: where an outside launcher (torchrun, srun, mpirun) started it, it ends with that
    launcher from now on, whatever kills the launcher (:func:`~shoal.core.guard.die_with_launcher`;
    shoal's own launcher's processes guard themselves before this). Under Lightning's
    launcher, local rank 0 is the launcher of the node's others."""
    env = detect_environment()
    if env is not None and (env.launcher in ("torchrun", "slurm", "mpi")
                            or (env.launcher == "lightning" and env.local_rank > 0)):
        die_with_launcher()
    return env


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel picks for ``bind(0)`` and outgoing connections (Linux), or the
    IANA range elsewhere."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago.

    It is drawn at random below the kernel's ephemeral range: a port the kernel handed out
    (``bind(0)``) is the next one it may give any outgoing connection on this machine as its
    source port, which then takes it before the job's store can listen there.

    Returns:
        The port number.
    """
    import random

    low, _ = _ephemeral_range()
    if low > 10_000:
        for _ in range(64):
            port = random.randrange(10_000, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_GIVEN: Environment | None = None  # handed over by shoal's launcher (set_environment)


def set_environment(env: Environment | None) -> None:
    """Make ``env`` what :func:`detect_environment` returns in this process (shoal's launcher
    calls it in each worker it starts; ``None`` reads the variables again)."""
    global _GIVEN
    _GIVEN = env


#: The cores of this node when it shares a machine with others (an emulated cluster's hosts:
#: :mod:`shoal.emulate` sets it), at most the cores this process may run on.
NODE_CORES = "SHOAL_NODE_CORES"


def default_threads(local_workers: int) -> int:
    """Cores available to this process (its node's share, :data:`NODE_CORES`) divided among
    the workers on this node."""
    cores = len(os.sched_getaffinity(0))
    share = os.environ.get(NODE_CORES, "")
    if share.isdigit() and int(share) > 0:
        cores = min(cores, int(share))
    return max(1, cores // max(1, local_workers))


def resolve_device(device: str, local_workers: int = 1, *, share: bool = False) -> str:
    """``cpu`` or ``cuda`` for this host's ``local_workers`` processes: ``auto`` is cuda when
    there is a GPU for each of them, else cpu; ``cuda`` with too few GPUs is a one-line error.
    NCCL runs one rank per GPU (it refuses two on one); ``share``: processes that never meet
    in NCCL (an asynchronous job's workers, which exchange through host memory) may share
    GPUs, so one GPU is enough for any number of them."""
    if device not in ("auto", "cpu", "cuda"):
        raise ShoalError(f"unknown device {device!r}; choose cpu, cuda or auto")
    if device == "cpu":
        return "cpu"
    import torch  # here: reading where this process sits must not import torch (cli.early)

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough = count > 0 and (share or count >= local_workers)
    if device == "auto":
        return "cuda" if enough else "cpu"
    if count == 0:
        raise ShoalError("--device cuda, but torch sees no CUDA GPU")
    if not enough:
        raise ShoalError(f"--device cuda: {local_workers} processes on this host need a GPU each "
                         f"(NCCL runs one rank per GPU), and {count} "
                         f"{'is' if count == 1 else 'are'} visible: start at most {count}, or "
                         "use the CPU")
    return "cuda"


def pick_device(device: str, local_rank: int, local_workers: int = 1, *,
                share: bool = False) -> torch.device:
    """This process's device (see :func:`resolve_device`): local rank r takes GPU r, or with
    ``share`` GPU r modulo their number; made current (``torch.cuda.set_device``)."""
    import torch

    if resolve_device(device, max(local_workers, local_rank + 1), share=share) == "cpu":
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
