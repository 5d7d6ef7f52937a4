"""How a strategy lays out a job's processes: :class:`Topology`.

Each strategy class declares it from its options (:meth:`Strategy.topology
<shoal.strategies.base.Strategy.topology>`): how many parameter servers, how many workers,
which workers compute together, and so which role each rank plays. The launch path reads it
(how many processes to start, or whether an outside launcher started the right number),
builds each rank's :class:`~shoal.core.comm.Comm` as it says and joins the groups it names;
``shoal bench`` and ``shoal plan`` count the processes of a run from it.

- Synchronous strategies: every rank is a worker, and all of them form one group, the job's
  process group.
- Asynchronous strategies: the first ``servers`` ranks are parameter servers (server 0 also
  coordinates: it keeps the run's records), the others are workers that meet only through
  the servers; a *compute group* of several workers (``groups``) also has a process group
  of its own.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from shoal.core.env import Environment
from shoal.errors import ShoalError


class Role(NamedTuple):
    """What one rank does: ``"server"`` ``index`` or ``"worker"`` ``index``."""

    kind: str
    index: int

    @property
    def is_server(self) -> bool:
        return self.kind == "server"

    def __str__(self) -> str:
        return f"{self.kind} {self.index}"


@dataclasses.dataclass(frozen=True)
class Topology:
    """A job's processes: ``servers`` parameter servers (ranks ``0 .. servers-1``), then
    ``workers`` workers; ``groups``, the ``[first, end)`` workers of each group that computes
    together (default: one group of every worker). ``shared_memory``: the workers step one
    parameter vector in one host's memory (hogwild), so they run on its CPU."""

    workers: int
    servers: int = 0
    groups: tuple[tuple[int, int], ...] = ()
    shared_memory: bool = False

    def __post_init__(self) -> None:
        if not self.groups:
            object.__setattr__(self, "groups", ((0, self.workers),))

    @property
    def world_size(self) -> int:
        """Processes of the job: servers and workers."""
        return self.servers + self.workers

    @property
    def detached(self) -> bool:
        """Whether the workers meet only through the servers (no process group of the whole
        job): server 0 then keeps the run's records from their reports."""
        return self.servers > 0

    @property
    def shares_gpus(self) -> bool:
        """Whether several workers may compute on one GPU: they meet in no NCCL group (only
        through the servers, in host memory), as every group is one worker."""
        return self.detached and all(end - first == 1 for first, end in self.groups)

    def role(self, rank: int) -> Role:
        """The role of rank ``rank``: the servers come first."""
        if not 0 <= rank < self.world_size:
            raise ShoalError(f"rank {rank} is outside a job of {self.world_size} processes")
        if rank < self.servers:
            return Role("server", rank)
        return Role("worker", rank - self.servers)

    def group(self, worker: int) -> tuple[int, int]:
        """The ``[first, end)`` workers of the group of worker ``worker``; one past the
        layout (a worker that joined an ``--elastic`` job) computes alone."""
        return next((g for g in self.groups if g[0] <= worker < g[1]), (worker, worker + 1))

    def place(self, env: Environment) -> Environment:
        """The place of ``env``'s rank among those it computes with: a worker's rank among
        the workers, on its host among the workers there (the servers are the first ranks
        of the first host). Server 0 keeps the records of the workers, so it speaks for them
        as rank 0 of the workers; another server is itself among the servers."""
        role = self.role(env.rank)
        if role.is_server:
            return dataclasses.replace(env, rank=role.index, local_rank=0, local_world_size=1,
                                       world_size=self.workers if role.index == 0 else self.servers)
        first_host = env.rank < env.local_world_size
        return dataclasses.replace(env, rank=role.index, world_size=self.workers,
                                   local_rank=max(0, env.local_rank - self.servers * first_host),
                                   local_world_size=self.local_workers(env))

    def local_workers(self, env: Environment) -> int:
        """Workers on ``env``'s host: its ranks, less the servers on the first host (they
        need neither a GPU nor cores to speak of)."""
        first_host = env.rank < env.local_world_size
        return max(1, env.local_world_size - self.servers * first_host)
