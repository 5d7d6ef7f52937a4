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

Each group of several workers is its own process group (``ProcessGroupGloo`` on the store
prefix ``groups/<first>``, this process's default group), declared by :meth:`topology` and
joined by the launch path before the strategy is built: a group's all-reduce and broadcast
never touch another group. The worker's own :class:`~shoal.core.comm.Comm` has no peers
(it meets the others through the servers); the group's is its ``subgroup``. Under
``--elastic`` the group's collectives are voted meetings of a membership of its own, and
the group re-forms from its members alive (:mod:`shoal.train.membership.tracker.compute_group`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.core.env import Environment
from shoal.core.ops import split_ranges, split_sizes
from shoal.errors import ShoalError
from shoal.schema import flag_name
from shoal.strategies.async_msgd import MomentumRule
from shoal.strategies.async_sgd import GradientOptions
from shoal.strategies.asynchronous import AsyncStrategy, check_server_sgd, one_setting
from shoal.strategies.communication import Exchange, Pattern
from shoal.strategies.registry import register
from shoal.strategies.sync import Synchronous
from shoal.strategies.topology import Topology


@dataclasses.dataclass
class GroupOptions(GradientOptions):
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
    grouped = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Any,
                 options: GroupOptions | None = None) -> None:
        check_server_sgd(self.name, model, optimizer, momentum=True)
        opts = options if options is not None else GroupOptions()
        opts.check_workers(comm.world_size)
        self.first, self.end = self.topology(opts, comm.world_size).group(comm.rank)
        size, rank = self.end - self.first, comm.rank - self.first
        if size > 1 and comm.ps is not None and comm.subgroup is None:
            raise ShoalError("groups: a compute group of several workers meets in a process "
                             "group of its own, which shoal train joins (run it with shoal train)")
        # The group's Comm: the one the launch path joined, else (no server: the preflight's
        # strategy alone, a loop of one's own) a group with no one to talk to.
        self.group = comm.subgroup if comm.subgroup is not None else \
            comm.child(Environment(rank=rank, world_size=size, local_world_size=size))
        # Inside the group the step is sync's: DDP, its loss weights and time booking.
        self.inner = Synchronous(model, optimizer, self.group)
        super().__init__(model, optimizer, comm, opts)
        self._grad = torch.zeros_like(self.flat.buffer)
        self._grad_views = self.flat.views(self._grad)
        #: ``--elastic`` (set by :class:`~shoal.train.membership.tracker.detached.AsyncElastic`): the
        #: deals server 0 published, as the leader reads them; every member takes those up
        #: to the leader's count at the same step (:attr:`agreed_deals`, sent with the
        #: parameters), so that the group walks one schedule.
        self.deal_count: Callable[[], int] | None = None
        self.agreed_deals = 0
        self._with_deals: torch.Tensor | None = None  # the parameters' bytes, then the count

    @classmethod
    def asynchronous_groups(cls, options: GroupOptions, workers: int) -> int:
        return options.groups

    @classmethod
    def topology(cls, options: GroupOptions, workers: int) -> Topology:
        """The servers, then the workers in ``--groups`` compute groups: a group of several
        workers has a process group of its own (its all-reduce and broadcast), which the
        launch path joins before the strategy is built."""
        return Topology(workers, cls.servers(options), tuple(group_bounds(workers, options.groups)))

    @classmethod
    def communication(cls, options: GroupOptions, workers: int) -> Pattern:
        """Every step, each group all-reduces its gradients, its leader pushes them and
        pulls the parameters, and the group takes them from the leader (at most one group
        per worker)."""
        groups = max(1, min(options.groups, workers))
        return Pattern(Exchange.GROUP_SERVER, "gradients, then parameters",
                       servers=options.servers, pushers=groups, groups=groups)

    @property
    def stop_peers(self) -> Any:
        """The group: its members meet at every step, so they stop after the same one."""
        return self.group

    def regroup(self) -> None:
        """The compute group was re-formed without a lost member (``--elastic``): DDP is
        wrapped again over the new group."""
        self.inner.regroup()

    def seat(self) -> tuple[int, int]:
        """Its compute group's workers, ``(first, end)``: they train as one."""
        return self.first, self.end

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
        if share is not None and not self.group_batches:  # else the group's batch already
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
        if self.deal_count is None:
            self.group.broadcast(self.flat.buffer, src=0, name="group parameters")
        else:
            self._broadcast_with_deals()
        self.flat.unpack()
        self.counted = self.carried  # the leader's exchange carried every member's work
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # the server stepped

    def _broadcast_with_deals(self) -> None:
        """The parameters and, after their bytes, the count of deals the leader read: one
        broadcast (under ``--elastic`` every collective of the group is a voted meeting,
        whose vote costs more than 8 bytes more)."""
        params = self.flat.buffer.view(torch.uint8)
        if self._with_deals is None:
            self._with_deals = params.new_empty(params.numel() + 8)
        both = self._with_deals
        # every member's own, which it sends where the meeting is held again from it
        both[:-8].copy_(params)
        count = self.deal_count() if self.leader and self.deal_count else self.agreed_deals
        both[-8:].copy_(torch.tensor([count], dtype=torch.int64).view(torch.uint8))
        self.group.broadcast(both, src=0, name="group parameters")
        params.copy_(both[:-8])
        self.agreed_deals = int(both[-8:].cpu().view(torch.int64).item())
