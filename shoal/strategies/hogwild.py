"""Hogwild!: lock-free SGD on parameters shared in one host's memory.

Niu, Recht, Re & Wright (2011), "Hogwild!: A lock-free approach to parallelizing stochastic
gradient descent", Algorithm 1. The parameters ``x`` live in shared memory; each worker
(processor) repeats, with no lock and no server::

    sample e uniformly at random from E          # here: its next mini-batch
    read the current state x_e and evaluate G_e(x)
    for v in e:  x_v <- x_v - gamma b_v^T G_e(x)   # in place, component by component

Another worker may write ``x`` between the read and the update, and an update may overwrite
another's on some components: the algorithm accepts both, in exchange for no worker ever
waiting. In shoal every worker maps one float32 file of the flat parameter vector (the
coordinator creates it and hands out its path through the job's store, key
:data:`PATH_KEY`) with ``torch.from_file(path, shared=True)``, makes its model's parameters
views into it and steps them in place with its optimizer: ``--optimizer sgd --momentum 0`` is
the paper's update (a momentum buffer or Adam's moments, if asked for, stay each worker's
own). Without a coordinator, the processes of a job share a file rank 0 creates; a process
alone takes an anonymous shared tensor. Shared memory is one host's and the host's:
a job over several hosts, or on CUDA, is refused in one line.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shoal.core.env import Environment, detect_environment
from shoal.core.trust import open_own
from shoal.errors import ShoalError
from shoal.strategies.asynchronous import AsyncStrategy
from shoal.strategies.base import NoOptions
from shoal.strategies.registry import register

#: The store key under which the coordinator sets the shared parameter file's path.
PATH_KEY = "hogwild/path"
#: ``--elastic``: the store key of the shared file of each worker's count (the samples of its
#: schedule its steps have put in the shared parameters) and steps, which server 0 reads when
#: a worker is lost: no exchange tells it, as it tells the servers of the other strategies.
COUNTS_KEY = "hogwild/counts"
#: Worker ids that file has a count for (joiners take new ids): a bound on its size.
COUNT_SLOTS = 4096


def check_one_host(env: Environment, device: torch.device) -> None:
    """Hogwild needs every worker in one host's memory: one line of why not, otherwise."""
    if device.type != "cpu":
        raise ShoalError(f"hogwild steps parameters shared in host memory, not on {device.type}: "
                         "run it with --device cpu")
    if env.local_world_size != env.world_size:
        raise ShoalError(f"hogwild shares the parameters in one host's memory, but this job spans "
                         f"several hosts ({env.world_size} processes, {env.local_world_size} on "
                         "this one): run it on one machine")


def create_shared_file(vector: torch.Tensor, directory: str | None = None) -> str:
    """A new file holding ``vector``'s values (flat, on the CPU), in ``/dev/shm`` where there
    is one; returns its path. Whoever creates it removes it."""
    if directory is None and os.path.isdir("/dev/shm"):
        directory = "/dev/shm"
    fd, path = tempfile.mkstemp(prefix="shoal-hogwild-", suffix=".bin", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(vector.detach().cpu().contiguous().numpy().tobytes())
    return path


def map_shared_file(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``path``'s ``numel`` values of ``dtype``, mapped shared: writes reach every mapper."""
    expected = numel * torch.empty((), dtype=dtype).element_size()
    try:
        os.close(open_own(Path(path)))  # the server's file: this user's, not through a link
        size = os.path.getsize(path)
    except OSError as exc:
        raise ShoalError(f"hogwild: cannot open the shared parameter file {path}: "
                         f"{exc.strerror}") from None
    if size != expected:
        raise ShoalError(f"hogwild: the shared parameter file {path} holds {size} bytes; the "
                         f"model's {numel} parameters need {expected}")
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


@register
class Hogwild(AsyncStrategy):
    """Hogwild!: workers step one shared parameter vector in place, lock-free (one host)."""

    name = "hogwild"
    Options = NoOptions
    Rule = None
    shared_memory = True

    @classmethod
    def asynchronous_groups(cls, options: NoOptions, workers: int) -> int:
        """Every worker steps the shared parameters on its own time: ``workers`` groups."""
        return workers

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: NoOptions | None = None) -> None:
        device = next((p.device for p in model.parameters() if p.device.type != "cpu"),
                      comm.device)
        check_one_host(detect_environment() or Environment(), device)
        self.shared: torch.Tensor | None = None  # the vector every worker steps
        self.counts: torch.Tensor | None = None  # --elastic: every worker's count (shared)
        super().__init__(model, optimizer, comm, options)

    @torch.no_grad()
    def start(self) -> None:
        """Make the parameters views into the shared vector: the coordinator's file, else one
        rank 0 creates for this job, else (alone) an anonymous shared tensor."""
        comm, vector = self.comm, self.flat.pack()
        if self.client is not None:
            shared = map_shared_file(shared_path(comm), vector.numel(), vector.dtype)
            self.counts = shared_counts(comm)
        elif comm.active:
            path = create_shared_file(vector) if comm.rank == 0 else None
            path = comm.broadcast_object(path)
            shared = map_shared_file(path, vector.numel(), vector.dtype)
            comm.barrier()  # every rank has mapped it: the name can go
            if comm.rank == 0:
                os.unlink(path)
        else:
            shared = vector.clone().share_memory_()
        self.shared = shared
        for p, view in zip(self.flat.tensors, self.flat.views(shared), strict=True):
            p.data = view

    def step(self) -> None:
        """``x <- x - gamma G(x)`` in place on the shared vector (the optimizer's step)."""
        self.steps += 1
        if self.batch_share is not None:
            self.samples += int(self.batch_share[0])
        self.local_step()
        self.counted = self.samples  # in the shared parameters now: it counts
        if self.counts is not None:  # the step after the count: server 0 reads them after
            self.counts[self.comm.rank, 0] = self.samples
            self.counts[self.comm.rank, 1] = self.steps

    @torch.no_grad()
    def rejoin(self) -> None:
        """Back from a rest (``--elastic``): the parameters are the shared ones already."""
        self.restored(False)

    def checkpoint_own(self) -> dict[str, Any]:
        """This worker's strategy state, optimizer and buffers; the shared parameters are
        the coordinator's to keep (the checkpoint's model)."""
        params = {name for name, _ in self.model.named_parameters()}
        return {"strategy": self.state_dict(), "optimizer": self.optimizer.state_dict(),
                "model": {k: v for k, v in self.model.state_dict().items() if k not in params}}

    def restore_checkpoint(self, shared: dict[str, Any], own: dict[str, Any] | None) -> None:
        """Put back this worker's own state. The shared parameters are put back by the
        coordinator; without one, this process puts them back itself."""
        if self.client is None:
            self.model.load_state_dict(shared["model"])
        if own is not None:
            self.model.load_state_dict(own["model"], strict=False)
            self.optimizer.load_state_dict(own["optimizer"])
            self.load_state_dict(own["strategy"])


def shared_counts(comm: Any) -> torch.Tensor | None:
    """The shared file of the workers' counts (``--elastic``; else ``None``), mapped."""
    if not comm.store.check([COUNTS_KEY]):
        return None
    if not 0 <= comm.rank < COUNT_SLOTS:
        raise ShoalError(f"hogwild --elastic keeps the counts of {COUNT_SLOTS} workers; this "
                         f"one is worker {comm.rank}")
    return map_counts(comm.store.get(COUNTS_KEY).decode())


def map_counts(path: str) -> torch.Tensor:
    """The counts file ``path`` mapped shared: a (samples, step) row per worker id."""
    return map_shared_file(path, 2 * COUNT_SLOTS, torch.int64).view(COUNT_SLOTS, 2)


def shared_path(comm: Any) -> str:
    """The shared parameter file's path, as the coordinator set it in the job's store."""
    store = comm.store
    if store is None:
        raise ShoalError("hogwild: this job's coordinator hands out the shared parameter file "
                         "through the job's store, and this process has no store")
    return store.get(PATH_KEY).decode()
