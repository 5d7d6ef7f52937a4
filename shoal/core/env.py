"""Where this process sits in a job: rank, world size, the job's address, its device and
its threads.

A job is either started by shoal itself (``--workers N`` spawns N local processes; each gets
its :class:`Environment` as an object) or by an outside launcher that already started one
process per rank: torchrun (``RANK`` ...), Slurm's ``srun`` (``SLURM_PROCID`` ...) or mpirun
(OpenMPI's ``OMPI_COMM_WORLD_*``, MPICH/Hydra's ``PMI_*``), read by
:func:`detect_environment`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.core.guard import die_with_launcher
from shoal.errors import ShoalError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Environment:
    """This process's place in the job. It travels as this object from the launcher to the
    code that joins the job; only user code that calls ``torch.distributed`` itself reads
    the variables :meth:`export` sets."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "none"  # none | local | torchrun | slurm | mpi
    #: The store at master_addr:master_port is served by the launcher (shoal's, or the
    #: torchrun agent), so every rank is its client; otherwise rank 0 serves it.
    agent_store: bool = False
    #: torchrun's restart count: keeps an earlier attempt's keys in the store apart.
    attempt: int = 0
    #: Where shoal's own launcher reads the ranks' failure reports (``None``: no such launcher).
    error_dir: str | None = None
    #: The job's secret (hex) that seals its store, where shoal's own launcher made it
    #: (:mod:`shoal.core.secret`); never shown.
    secret: str | None = field(default=None, repr=False, compare=False)

    def export(self) -> None:
        """Set the variables torch.distributed's ``env://`` rendezvous reads (for user code
        that initializes a process group itself)."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )
        if self.agent_store:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise ShoalError(f"environment variable {name}={env[name]!r} is not an integer") from None
    if default is None:
        raise ShoalError(f"environment variable {names[0]} is not set")
    return default


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``gpu[01-03,7],login1`` into host names."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def detect_environment(env: Mapping[str, str] | None = None) -> Environment | None:
    """The job this process belongs to, if a launcher started it; else ``None``.

    A process shoal's own launcher started gets its :class:`Environment` handed over as an
    object (:func:`set_environment`). Otherwise the variables are read, in order: torchrun
    (or any launcher that sets ``RANK``/``WORLD_SIZE``), Slurm (``srun`` with more than one
    task), OpenMPI, MPICH/Hydra; an MPI launcher's before Slurm's inside an allocation.
    """
    if env is None:
        if _GIVEN is not None:
            return _GIVEN
        env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return Environment(
            rank=_int(env, "RANK"),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", default=0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", default=world),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", default=29500),
            launcher="torchrun",
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            attempt=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0),
        )
    if _mpi_under_slurm(env):
        return _mpi(env)
    return _slurm(env) or _mpi(env)


def _mpi_under_slurm(env: Mapping[str, str]) -> bool:
    """Whether an MPI launcher started this process inside a Slurm allocation (``salloc``
    then ``mpiexec``): its rank and size are the launcher's, and the ``SLURM_*`` task ids
    are those of the launcher's proxies (one a node: two ranks of a node share one).
    Decided the same way on every rank of a job (a rank whose MPI rank happened to equal
    its proxy's id went the other way, and the job split): the MPI job's size against the
    Slurm step's task count, which are equal under ``srun --mpi`` (srun's own PMI)."""
    for size, *_ in _MPI_VARIABLES:
        if size in env:
            return env[size] != env.get("SLURM_STEP_NUM_TASKS")
    return False


def rank_environment() -> Environment | None:
    """:func:`detect_environment`, for a process about to act as a rank of the job it
    finds: where an outside launcher (torchrun, srun, mpirun) started it, it ends with that
    launcher from now on, whatever kills the launcher (:func:`~shoal.core.guard.die_with_launcher`;
    shoal's own launcher's processes guard themselves before this)."""
    env = detect_environment()
    if env is not None and env.launcher in ("torchrun", "slurm", "mpi"):
        die_with_launcher()
    return env


def _slurm(env: Mapping[str, str]) -> Environment | None:
    """The job of ``srun`` with more than one task, else ``None``."""
    if "SLURM_PROCID" not in env or _int(env, "SLURM_NTASKS", default=1) <= 1:
        return None
    addr = env.get("MASTER_ADDR")
    if addr is None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ShoalError("under Slurm, set MASTER_ADDR or SLURM_JOB_NODELIST")
        addr = expand_hostlist(nodes)[0]
    job = _int(env, "SLURM_JOB_ID", default=0)
    return Environment(
        rank=_int(env, "SLURM_PROCID"),
        world_size=_int(env, "SLURM_NTASKS"),
        local_rank=_int(env, "SLURM_LOCALID", default=0),
        local_world_size=_slurm_tasks_here(env),
        master_addr=addr,
        master_port=_int(env, "MASTER_PORT", default=10000 + job % 20000),
        launcher="slurm",
    )


def _slurm_tasks_here(env: Mapping[str, str]) -> int:
    """The tasks of this step on this node: ``--ntasks-per-node``'s count, else this node's
    (``SLURM_NODEID``) entry of ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2 on each of the
    first three nodes, then 1), which srun sets for every step; 1 where neither is there."""
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return _int(env, "SLURM_NTASKS_PER_NODE")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    node, counts = _int(env, "SLURM_NODEID", default=0), []
    for item in spec.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if found is None:
            return 1
        counts += [int(found[1])] * min(int(found[2] or 1), node + 1 - len(counts))
        if len(counts) > node:
            return max(1, counts[node])
    return 1


#: Each MPI launcher's variables: the size, the rank, the node's rank and size (OpenMPI's,
#: then MPICH/Hydra's).
_MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _mpi(env: Mapping[str, str]) -> Environment | None:
    """The job of OpenMPI's or MPICH/Hydra's ``mpirun`` with more than one rank, else ``None``."""
    for size, rank, local, local_size in _MPI_VARIABLES:
        if size in env and _int(env, size) > 1:
            if "MASTER_ADDR" not in env:
                raise ShoalError(
                    "under mpirun, set MASTER_ADDR (and MASTER_PORT) to the address of rank 0's "
                    "host, e.g. mpirun -x MASTER_ADDR=node1 ..."
                )
            world = _int(env, size)
            return Environment(
                rank=_int(env, rank),
                world_size=world,
                local_rank=_int(env, local, default=0),
                local_world_size=_int(env, local_size, default=world),
                master_addr=env["MASTER_ADDR"],
                master_port=_int(env, "MASTER_PORT", default=29500),
                launcher="mpi",
            )
    return None


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
