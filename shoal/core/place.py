"""This process's place in a job (:class:`Environment`): made by shoal's own launcher, or
read from an outside launcher's variables (:mod:`shoal.core.launchers`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


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
    launcher: str = "none"  # none | local | torchrun | slurm | mpi | lightning
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
