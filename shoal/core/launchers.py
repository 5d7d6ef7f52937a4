"""Each outside launcher's variables, read into the :class:`~shoal.core.env.Environment` of
the process it started.

- torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT``. So do Accelerate's ``accelerate launch`` (which runs
  torchrun) and Ray Train (``TorchTrainer``, before the training function; with ``NODE_RANK``).
- Lightning's own launcher (``python train.py`` with ``Trainer(devices=N)``) sets
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, and no
  ``RANK``: Lightning makes it ``NODE_RANK x N + LOCAL_RANK`` itself.
- Slurm's ``srun`` sets ``SLURM_PROCID``, ``SLURM_NTASKS`` and the rest.
- mpirun sets its MPI's: OpenMPI's ``OMPI_COMM_WORLD_*``, MPICH/Hydra's and Intel MPI's
  ``PMI_*``, MVAPICH2's ``MV2_COMM_WORLD_*`` (all three read by ``accelerate launch
  --mpirun_hostfile``'s ranks too).

Variables that name a job of several processes but not this process's place in it are
refused in one line. They never make a job of one, whose collectives would return their
input and train alone without a word.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from shoal.core.place import Environment
from shoal.errors import ShoalError


def read_launcher(env: Mapping[str, str]) -> Environment | None:
    """The job that the launcher variables ``env`` describe.

    Read in order: torchrun's (``RANK`` with ``WORLD_SIZE``); an MPI launcher's before
    Slurm's inside an allocation; Slurm's (``srun`` with more than one task); MPI's;
    Lightning's.

    Args:
        env: The variables (``os.environ``, or a test's table).

    Returns:
        This process's place in the job, or ``None`` where ``env`` names no job of more
        than one process.

    Raises:
        ShoalError: A variable that is not a number, a rank outside its job, or a partial
            set that names a job of several processes without this process's rank in it.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        found = _torchrun(env)
    elif _mpi_under_slurm(env):
        found = _mpi(env)
    else:
        found = _slurm(env) or _mpi(env) or _lightning(env)
    if found is None:
        _refuse_partial(env)
        return None
    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        raise ShoalError(f"{found.launcher}'s variables put this process at rank {found.rank} "
                         f"of a job of {found.world_size} processes")
    return found


def variable(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    """The integer value of the first of ``names`` set in ``env``, else ``default``.

    Raises:
        ShoalError: The value is not an integer, or none is set and there is no default.
    """
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise ShoalError(f"environment variable {name}={env[name]!r} is not an integer") from None
    if default is None:
        raise ShoalError(f"environment variable {names[0]} is not set")
    return default


def _torchrun(env: Mapping[str, str]) -> Environment:
    """torchrun's variables (Accelerate's and Ray Train's are the same)."""
    world = variable(env, "WORLD_SIZE")
    return Environment(
        rank=variable(env, "RANK"),
        world_size=world,
        local_rank=variable(env, "LOCAL_RANK", default=0),
        local_world_size=variable(env, "LOCAL_WORLD_SIZE", default=world),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=variable(env, "MASTER_PORT", default=29500),
        launcher="torchrun",
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        attempt=variable(env, "TORCHELASTIC_RESTART_COUNT", default=0),
    )


def _lightning(env: Mapping[str, str]) -> Environment | None:
    """Lightning's own launcher: ``WORLD_SIZE`` (devices x nodes), ``LOCAL_RANK``, the node
    (``NODE_RANK``, else ``GROUP_RANK``, else 0, as ``LightningEnvironment.node_rank``), no
    ``RANK``. The rank is ``node x devices + LOCAL_RANK``, as Lightning's DDP strategy makes
    it. The devices of a node are the ``Trainer``'s argument, which Lightning does not
    export: ``LOCAL_WORLD_SIZE`` where set; else on node 0 all of ``WORLD_SIZE`` (one node:
    the rank is ``LOCAL_RANK`` on node 0 whatever the count); else refused."""
    if "RANK" in env or "WORLD_SIZE" not in env or "LOCAL_RANK" not in env:
        return None
    world, local = variable(env, "WORLD_SIZE"), variable(env, "LOCAL_RANK")
    if world <= 1:
        return None
    node = variable(env, "NODE_RANK", "GROUP_RANK", default=0)
    if "LOCAL_WORLD_SIZE" in env:
        per_node = variable(env, "LOCAL_WORLD_SIZE")
    elif node == 0:
        per_node = world
    else:
        raise ShoalError(f"NODE_RANK={node}, LOCAL_RANK={local}, WORLD_SIZE={world} and no RANK "
                         "(Lightning's launcher): this process's rank needs its node's number of "
                         "processes, which Lightning does not export; set LOCAL_WORLD_SIZE to "
                         "the Trainer's devices, or RANK")
    if per_node < 1 or world % per_node or not 0 <= local < per_node:
        raise ShoalError(f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={per_node} and WORLD_SIZE={world} "
                         "(Lightning's launcher) are not a rank among equal nodes")
    return Environment(
        rank=node * per_node + local,
        world_size=world,
        local_rank=local,
        local_world_size=per_node,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=variable(env, "MASTER_PORT", default=29500),
        launcher="lightning",
    )


def _refuse_partial(env: Mapping[str, str]) -> None:
    """Refuse variables that no launcher's reading took but that name a job of several
    processes (or a place in one other than the first)."""
    if "RANK" in env:
        raise ShoalError(f"RANK={env['RANK']} is set but WORLD_SIZE is not: set both, as torchrun "
                         "does (or neither, for a process on its own)")
    world = variable(env, "WORLD_SIZE", default=1)
    if world > 1:
        raise ShoalError(f"WORLD_SIZE={world} is set but not this process's rank: set RANK "
                         "(torchrun's variables), or LOCAL_RANK and NODE_RANK (Lightning's)")
    if world < 1:
        raise ShoalError(f"WORLD_SIZE={world} is not a number of processes")
    local = variable(env, "LOCAL_RANK", default=0)
    if local != 0:
        raise ShoalError(f"LOCAL_RANK={local} is set but no WORLD_SIZE: this process is not the "
                         "only one of its job; set WORLD_SIZE and RANK")


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


def _slurm(env: Mapping[str, str]) -> Environment | None:
    """The job of ``srun`` with more than one task, else ``None``."""
    if "SLURM_PROCID" not in env or variable(env, "SLURM_NTASKS", default=1) <= 1:
        return None
    addr = env.get("MASTER_ADDR")
    if addr is None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ShoalError("under Slurm, set MASTER_ADDR or SLURM_JOB_NODELIST")
        addr = expand_hostlist(nodes)[0]
    job = variable(env, "SLURM_JOB_ID", default=0)
    return Environment(
        rank=variable(env, "SLURM_PROCID"),
        world_size=variable(env, "SLURM_NTASKS"),
        local_rank=variable(env, "SLURM_LOCALID", default=0),
        local_world_size=_slurm_tasks_here(env),
        master_addr=addr,
        master_port=variable(env, "MASTER_PORT", default=10000 + job % 20000),
        launcher="slurm",
    )


def _slurm_tasks_here(env: Mapping[str, str]) -> int:
    """The tasks of this step on this node: ``--ntasks-per-node``'s count, else this node's
    (``SLURM_NODEID``) entry of ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2 on each of the
    first three nodes, then 1), which srun sets for every step; 1 where neither is there."""
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return variable(env, "SLURM_NTASKS_PER_NODE")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    node, counts = variable(env, "SLURM_NODEID", default=0), []
    for item in spec.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if found is None:
            return 1
        counts += [int(found[1])] * min(int(found[2] or 1), node + 1 - len(counts))
        if len(counts) > node:
            return max(1, counts[node])
    return 1


#: Each MPI launcher's variables: the size, the rank, the node's rank and size (OpenMPI's,
#: MPICH/Hydra's and Intel MPI's, MVAPICH2's).
_MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"),
)


def _mpi(env: Mapping[str, str]) -> Environment | None:
    """The job of an MPI launcher's ``mpirun`` with more than one rank, else ``None``."""
    for size, rank, local, local_size in _MPI_VARIABLES:
        if size in env and variable(env, size) > 1:
            if "MASTER_ADDR" not in env:
                raise ShoalError(
                    "under mpirun, set MASTER_ADDR (and MASTER_PORT) to the address of rank 0's "
                    "host, e.g. mpirun -x MASTER_ADDR=node1 ..."
                )
            world = variable(env, size)
            return Environment(
                rank=variable(env, rank),
                world_size=world,
                local_rank=variable(env, local, default=0),
                local_world_size=variable(env, local_size, default=world),
                master_addr=env["MASTER_ADDR"],
                master_port=variable(env, "MASTER_PORT", default=29500),
                launcher="mpi",
            )
    return None
