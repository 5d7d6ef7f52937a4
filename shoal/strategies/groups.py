"""Compute groups (Omnivore): synchronous inside a group, asynchronous across groups.

Hadjis, Zhang, Mitliagkas, Iter & Re (2016), "Omnivore: An Optimizer for Multi-device Deep
Learning on CPUs and GPUs", Section 3: the ``W`` workers form ``g`` compute groups (here of
contiguous ranks, as even as possible); a parameter server holds ``x``. Each group ``k``
repeats, never waiting for another group::

    every worker i of group k:  g^i <- gradient of its rows of the batch at x_k
    g_k <- sum_i n_i g^i / n_k             # DDP's all-reduce inside the group (n: rows)
    the group's leader pushes g_k; the server, on arrival:
        v <- mu v + (g_k + lambda x)       # one velocity for all groups (async-msgd's rule)
        x <- x - eta v
    the leader pulls x_k <- x and broadcasts it to its group

``g = 1`` is synchronous SGD with heavy-ball momentum (``sync`` with the same optimizer, one
step per global batch); ``g = W`` is Async MSGD (``async-msgd``; ``async-sgd`` at ``mu = 0``).
In between, a group's step is a larger synchronous batch, and the groups are asynchronous to
each other: their pushes are on average ``g - 1`` versions stale. Mitliagkas et al. (2016),
"Asynchrony begets momentum", show such a run behaves as if it had an implicit momentum of
about ``1 - 1/g``; Omnivore therefore lowers the explicit ``mu`` as ``g`` grows
(``--momentum auto``: ``max(0, target - (1 - 1/g))``).

Each group is its own process group (``ProcessGroupGloo`` on the store prefix
``groups/k``, this process's default group): a group's all-reduce and broadcast never touch
another group. The trainer's own :class:`~shoal.core.comm.Comm` stays detached
(``peers=False``); the group's is its :meth:`~shoal.core.comm.Comm.child`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from shoal.core.env import Environment
from shoal.core.group import join_group
from shoal.core.ops import split_ranges, split_sizes
from shoal.errors import ShoalError
from shoal.schema import flag_name
from shoal.strategies.async_msgd import MomentumRule
from shoal.strategies.asynchronous import AsyncOptions, AsyncStrategy, check_server_sgd, one_setting
from shoal.strategies.registry import register
from shoal.strategies.sync import Synchronous


@dataclasses.dataclass
class GroupOptions(AsyncOptions):
    """Options of ``groups``: the server's, and how many compute groups."""

    groups: int = dataclasses.field(default=1, metadata={
        "help": "compute groups: synchronous inside, asynchronous across (1: sync; "
                "workers: async-msgd)"})

    def validate(self) -> None:
        super().validate()
        if self.groups < 1:
            raise ShoalError(f"{flag_name('groups')} must be at least 1, got {self.groups}")

    #: The groups' leaders push: the staleness bound counts groups.
    pusher: ClassVar[str] = "group"

    def check_workers(self, workers: int) -> None:
        """At most one group per worker; the staleness bound counts groups (their leaders
        push), so it must be at least ``groups - 1``."""
        if self.groups > workers:
            raise ShoalError(f"{flag_name('groups')} {self.groups} with {workers} workers: a "
                             "group needs a worker at least")
        super().check_workers(workers)

    def pushers(self, workers: int) -> list[int]:
        """The group leaders: the first worker of each group pushes its group's gradient."""
        return [first for first, _ in group_bounds(workers, self.groups)]


def group_bounds(workers: int, groups: int) -> list[tuple[int, int]]:
    """The ``[first, end)`` workers of each compute group: contiguous, as even as possible."""
    return split_ranges(workers, groups)


@register
class ComputeGroups(AsyncStrategy):
    """Omnivore's compute groups: sync inside a group, async across groups (--groups)."""

    name = "groups"
    Options = GroupOptions
    Rule = MomentumRule

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Any,
                 options: GroupOptions | None = None) -> None:
        check_server_sgd(self.name, model, optimizer, momentum=True)
        opts = options if options is not None else GroupOptions()
        opts.check_workers(comm.world_size)
        self.first, self.end = next(
            b for b in group_bounds(comm.world_size, opts.groups) if b[0] <= comm.rank < b[1])
        size, rank = self.end - self.first, comm.rank - self.first
        if size > 1 and getattr(comm, "ps", None) is not None:
            self._join(comm, self.first, rank, size)
        self.group = comm.child(Environment(rank=rank, world_size=size, local_world_size=size))
        # Inside the group the step is sync's: DDP, its loss weights and time booking.
        self.inner = Synchronous(model, optimizer, self.group)
        super().__init__(model, optimizer, comm, opts)
        self._grad = torch.zeros_like(self.flat.buffer)
        self._grad_views = self.flat.views(self._grad)

    @staticmethod
    def _join(comm: Any, first: int, rank: int, size: int) -> None:
        """Join this group's process group (the job's store, prefix ``groups/<first>``)."""
        store = getattr(comm, "store", None)
        if store is None:
            raise ShoalError("groups: a compute group meets through the job's store, and this "
                             "process has none (run it with shoal train)")
        if dist.is_initialized():
            raise ShoalError("groups: this process already belongs to a process group; a "
                             "compute group's worker joins its group's own")
        join_group(dist.PrefixStore(f"groups/{first}", store), rank, size, comm.device.type,
                   comm.ps.timeout, where=f"the compute group of workers {first}..")

    @classmethod
    def asynchronous_groups(cls, options: GroupOptions, workers: int) -> int:
        return options.groups

    @classmethod
    def may_share_gpus(cls, options: GroupOptions, workers: int) -> bool:
        """A group of several workers all-reduces in NCCL: one GPU each, unless every group
        is one worker."""
        return options.groups >= workers

    @property
    def stop_peers(self) -> Any:
        """The group: its members meet at every step, so they stop after the same one."""
        return self.group

    @property
    def leader(self) -> bool:
        return self.comm.rank == self.first

    @property
    def module(self) -> nn.Module:
        return self.inner.module

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate through the group's DDP, this worker's loss weighted by its share of
        the group's rows (the trainer's :attr:`batch_share` is of the global batch)."""
        share = self.batch_share
        if share is not None:
            n_local, n_global = share
            rows = split_sizes(n_global, self.comm.world_size)[self.first:self.end]
            share = (n_local, sum(rows))
        self.inner.batch_share, self.inner.scaler = share, self.scaler
        self.inner.backward(loss)

    def no_sync(self, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        return self.inner.no_sync(enabled)

    @torch.no_grad()
    def update(self, t: int) -> None:
        """The leader pushes the group's gradient and pulls the server's parameters; the
        group takes them from the leader."""
        one_setting(self.name, self.optimizer)
        if self.leader:
            for view, p in zip(self._grad_views, self.flat.tensors, strict=True):
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
            self.exchange(self._grad, self.flat.buffer)
        self.group.broadcast(self.flat.buffer, src=0, name="group parameters")
        self.flat.unpack()
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # the server stepped
