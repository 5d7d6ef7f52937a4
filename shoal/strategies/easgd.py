"""Synchronous Elastic Averaging SGD and its momentum form, as published.

Zhang, Choromanska & LeCun (2015), "Deep learning with Elastic Averaging SGD". Algorithm 1
(EASGD) is run by every worker ``i``, ``t`` counting its local steps::

    x = x^i
    if tau divides t:
        a)  x^i <- x^i - alpha (x - x~)        # the worker is pulled towards the center
        b)  x~  <- x~  + alpha (x - x~)        # the center is pulled towards the worker
    x^i <- x^i - eta g(x)                      # the gradient is taken at x, before the pull

In the synchronous form (the paper's equations 5-6 for ``tau = 1``; Sync EASGD in You, Buluc
& Demmel 2017) every worker does a) and b) at the same moment against the same ``x~``, so
the center moves by the sum of all pulls, ``x~ <- x~ + sum_i alpha (x^i - x~)``, which is
``x~ <- (1 - beta) x~ + beta mean_i(x^i)`` with ``beta = p alpha``: stable only for
``beta <= 2`` (the paper uses ``beta = 0.9``, shoal's default ``alpha = 0.9 / p``).

How that maps onto shoal's steps: the ``tau``-th local step ends with :meth:`exchange`,
which computes every pull ``d = alpha (x - x~)`` and starts one packed all-reduce of them
for b). The worker's own pull a) waits for the next local step, whose gradient backward has
already taken at ``x``: it is subtracted right after that step's update. The center is next
read ``tau`` steps later, so the all-reduce travels behind those steps' compute and is added
to the center only when the center is needed (the next exchange, evaluation or a
checkpoint); ``--no-overlap`` waits for it at once. Each worker keeps its own copy of the
center; the copies are broadcast from rank 0 at each epoch's end so rounding cannot make
them drift apart. The model evaluated and saved is the center.

``eamsgd`` is Algorithm 2 (EAMSGD): the same coupling with Nesterov momentum ``delta`` on
the local steps, written in the paper's own variables (see :class:`ElasticAveragingMomentum`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shoal.core import FlatParams
from shoal.errors import ShoalError
from shoal.strategies.averaging import ModelCopy, average_buffers
from shoal.strategies.communication import Pattern
from shoal.strategies.periodic import PeriodicOptions, PeriodicStrategy
from shoal.strategies.registry import register
from shoal.strategies.streaming import Fragment

#: The center update ``x~ <- (1 - beta) x~ + beta mean(x)`` diverges for ``beta > 2``.
MAX_BETA = 2.0


@dataclass
class ElasticOptions(PeriodicOptions):
    alpha: float | None = field(default=None, metadata={
        "help": "elastic moving rate (default 0.9 / workers)"})
    overlap: bool = field(default=True, metadata={
        "help": "hide the center's all-reduce behind the next local steps"})

    def validate(self) -> None:
        super().validate()
        if self.alpha is not None and not 0 <= self.alpha <= 1:
            raise ShoalError(f"--alpha must be in [0, 1], got {self.alpha}")

    def moving_rate(self, workers: int) -> float:
        """``alpha``: as given, or the paper's ``beta = 0.9`` spread over the workers."""
        return self.alpha if self.alpha is not None else 0.9 / workers

    def check_workers(self, workers: int) -> None:
        beta = self.moving_rate(workers) * workers
        if beta > MAX_BETA:
            raise ShoalError(f"--alpha {self.alpha:g} with {workers} workers gives beta = "
                             f"{round(beta, 6)}; the center update needs alpha * workers <= 2")


def parameter_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The model's parameters, those of each optimizer group together and in group order,
    then any the optimizer does not step: each group is one contiguous slice of a flat
    vector in this order (until strided fragments deal its layers out)."""
    mine = {id(p) for p in model.parameters()}
    order: list[nn.Parameter] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in mine:
                raise ShoalError("the optimizer steps a tensor that is not a parameter of the model")
            order.append(p)
    stepped = {id(p) for p in order}
    return order + [p for p in model.parameters() if id(p) not in stepped]


@register
class ElasticAveraging(PeriodicStrategy):
    """Sync EASGD: every --tau steps, an elastic pull between each worker and the center."""

    name = "easgd"
    Options = ElasticOptions

    @classmethod
    def communication(cls, options: ElasticOptions, workers: int) -> Pattern:
        """The elastic pulls' all-reduce every ``tau`` steps, behind the next steps'
        compute (``--no-overlap``: waited for at once)."""
        return cls.outer_pattern(options, workers, "elastic pulls", hidden=options.overlap)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: ElasticOptions | None = None) -> None:
        super().__init__(model, optimizer, comm, options)
        self.alpha = self.options.moving_rate(comm.world_size)
        order = self.fragment_order(parameter_order(model, optimizer))
        self.flat = FlatParams(order)
        self.center = ModelCopy(model, order)  # x~, laid out as self.flat
        comm.broadcast(self.center.vector, src=0, name="center")  # one center to start from
        self.flat.unpack(self.center.vector)  # and x^i = x~ (the algorithms' initialization)
        self._pull = torch.zeros_like(self.center.vector)  # d = alpha (x - x~): line a), pending
        self._sum = torch.zeros_like(self.center.vector)  # every worker's d, being summed: b)
        self.stream(self.flat)
        count = len(self.exchanges.fragments)
        self._pull_due = [False] * count  # each fragment's d, to subtract at the next step
        self._pending: list[Any] = [None] * count  # each fragment's sum in flight

    @property
    def eval_module(self) -> nn.Module:
        self._finish()
        return self.center.with_buffers_of(self.model)

    def worker_vector(self) -> torch.Tensor:
        """``x^i`` as one flat vector (laid out as :attr:`flat`)."""
        return self.flat.pack()

    @torch.no_grad()
    def local_step(self) -> None:
        """``x^i <- x^i - eta g(x)`` (your optimizer's step), then line a) if it is due."""
        super().local_step()
        pull = self._take_pull()
        if pull is not None:
            for x, d in zip(self.flat.tensors, self.flat.views(pull), strict=True):
                x.sub_(d)

    def _take_pull(self) -> torch.Tensor | None:
        """Line a)'s ``d``, decided at the last exchange, if it has not been applied yet
        (zero on the fragments whose ``d`` is not due)."""
        if not any(self._pull_due):
            return None
        for fragment, due in zip(self.exchanges.fragments, self._pull_due, strict=True):
            if not due:
                self._pull[fragment.lo:fragment.hi].zero_()
        self._pull_due = [False] * len(self._pull_due)
        return self._pull

    @torch.no_grad()
    def launch(self, fragment: Fragment) -> dict:
        """Lines a) and b) of the next step for the fragment, from the worker's x now."""
        lo, hi = fragment.lo, fragment.hi
        self._finish(fragment.index)
        pull = self._pull[lo:hi]
        torch.sub(self.worker_vector()[lo:hi], self.center.vector[lo:hi], out=pull).mul_(self.alpha)
        self._sum[lo:hi].copy_(pull)
        self._pending[fragment.index] = self.exchanges.send(fragment, self._sum[lo:hi], "elastic",
                                                            mean=False)
        if not self.options.overlap:
            self._finish(fragment.index)
        return {}

    @torch.no_grad()
    def complete(self, fragment: Fragment, kept: dict, moved: bool) -> None:
        """Line a): at the next step, or, after overlapped steps, now; and line b) now."""
        if not moved:
            self._pull_due[fragment.index] = True
            return
        self.apply_pull(fragment)
        self._finish(fragment.index)

    @torch.no_grad()
    def apply_pull(self, fragment: Fragment) -> None:
        """``x^i <- x^i - d`` on the fragment, at once."""
        pull = self._pull[fragment.lo:fragment.hi]
        for x, d in zip(fragment.flat.tensors, fragment.flat.views(pull), strict=True):
            x.sub_(d)

    @torch.no_grad()
    def _finish(self, index: int | None = None) -> None:
        """Line b) for every worker: add the sum of their pulls to the center (of fragment
        ``index``, or all of them)."""
        for fragment in self.exchanges.fragments:
            pending = self._pending[fragment.index]
            if pending is not None and index in (None, fragment.index):
                self.center.vector[fragment.lo:fragment.hi].add_(pending.wait())
                self._pending[fragment.index] = None

    def end_epoch(self, epoch: int) -> None:
        self.drain()
        self._finish()
        self.comm.broadcast(self.center.vector, src=0, name="center")
        average_buffers(self.model, self.comm)

    def state_dict(self) -> dict:
        self._finish()
        return {**super().state_dict(), "center": self.center.vector.clone(),
                "pull": self._pull.clone(), "pull_due": list(self._pull_due)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.center.vector.copy_(state["center"])
        if "pull" in state:
            self._pull.copy_(state["pull"])
            due = state["pull_due"]
            self._pull_due = list(due) if isinstance(due, list) else [bool(due)] * len(self._pull_due)


def group_runs(flat: FlatParams, optimizer: torch.optim.Optimizer) -> list[tuple[int, int, int]]:
    """``(lo, hi, k)`` for each run of ``flat``'s consecutive tensors that optimizer group
    ``k`` steps: one a group in :func:`parameter_order`, more when strided fragments
    interleave the groups' layers (``k``, not the group: loading a state replaces them)."""
    group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
    runs: list[tuple[int, int, int]] = []
    lo = 0
    for t in flat.tensors:
        k, hi = group_of.get(id(t)), lo + t.numel()
        if k is not None and runs and runs[-1][1:] == (lo, k):
            runs[-1] = (runs[-1][0], hi, k)
        elif k is not None:
            runs.append((lo, hi, k))
        lo = hi
    return runs


def check_nesterov_sgd(name: str, optimizer: torch.optim.Optimizer) -> None:
    """EAMSGD's local steps are SGD with momentum ``delta`` (the optimizer's), nothing else."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ShoalError(f"{name} takes local steps with SGD, not {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if group["momentum"] <= 0 or group["dampening"] != 0:
            raise ShoalError(f"{name} needs --momentum > 0 (and no dampening)")
        if group.get("maximize"):
            raise ShoalError(f"{name} minimizes; SGD(maximize=True) is not supported")


class NesterovLocalSteps:
    """The local step of EAMSGD (Algorithm 2 of Zhang et al. 2015) in its own variables::

        v^i <- delta v^i - eta g(x^i + delta v^i)
        x^i <- x^i + v^i              (after the elastic pull x^i <- x^i - d, when one is due)

    The gradient is taken at the look-ahead point ``x + delta v``, so the model's parameters
    (``flat``) hold that point, and this class keeps ``x`` and ``v`` themselves. PyTorch's
    Nesterov SGD cannot stand in for it: it stores only the look-ahead point, whose relation
    to ``x`` depends on the learning rate of the step that made it, and the pull must move
    ``x``, not it. ``eta``, ``delta`` and weight decay are read from the optimizer's groups
    (:func:`group_runs`) at every step, so learning-rate schedules apply exactly.
    """

    def __init__(self, flat: FlatParams, optimizer: torch.optim.Optimizer) -> None:
        self.flat, self.optimizer = flat, optimizer
        self.x = flat.pack().clone()  # x^i; the parameters hold x^i + delta v^i
        self.v = torch.zeros_like(self.x)  # v^i
        self._grad = torch.zeros_like(self.x)
        self._grad_views = flat.views(self._grad)
        self._runs = group_runs(flat, optimizer)  # each group's slices of x, v and the gradient

    @torch.no_grad()
    def step(self, pull: torch.Tensor | None = None) -> None:
        """``v <- delta v - eta g(x + delta v)``; ``x <- x - pull`` if one is given;
        ``x <- x + v``; then the parameters move to the next look-ahead point ``x + delta v``."""
        for view, p in zip(self._grad_views, self.flat.tensors, strict=True):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
        look_ahead = self.flat.pack()
        for lo, hi, k in self._runs:
            group, g, v = self.optimizer.param_groups[k], self._grad[lo:hi], self.v[lo:hi]
            if group["weight_decay"]:
                g.add_(look_ahead[lo:hi], alpha=group["weight_decay"])
            v.mul_(group["momentum"]).add_(g, alpha=-float(group["lr"]))
        if pull is not None:
            self.x.sub_(pull)
        self.x.add_(self.v)
        self.move_to_look_ahead()
        # This step is the optimizer's step: tell a learning-rate scheduler watching for
        # optimizer.step() that it happened, or it warns that the schedule is off by one.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    @torch.no_grad()
    def move_to_look_ahead(self) -> None:
        """Set the parameters to ``x + delta v`` (each group's ``delta``)."""
        look_ahead = self.flat.buffer
        look_ahead.copy_(self.x)
        for lo, hi, k in self._runs:
            look_ahead[lo:hi].add_(self.v[lo:hi], alpha=self.optimizer.param_groups[k]["momentum"])
        self.flat.unpack(look_ahead)


@register
class ElasticAveragingMomentum(ElasticAveraging):
    """Sync EAMSGD: EASGD whose local steps use Nesterov momentum (--momentum)."""

    name = "eamsgd"

    # Algorithm 2 of the paper, for worker i (as Algorithm 1, with a velocity v^i):
    #
    #     x = x^i
    #     if tau divides t:  a) x^i <- x^i - alpha (x - x~)   b) x~ <- x~ + alpha (x - x~)
    #     v^i <- delta v^i - eta g(x + delta v^i)
    #     x^i <- x^i + v^i
    #
    # The local step in x and v is NesterovLocalSteps; the parameters hold x + delta v.

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: ElasticOptions | None = None) -> None:
        check_nesterov_sgd("eamsgd", optimizer)
        super().__init__(model, optimizer, comm, options)
        self.nesterov = NesterovLocalSteps(self.flat, optimizer)
        self.x, self.v = self.nesterov.x, self.nesterov.v  # x^i and v^i (the same tensors)

    def worker_vector(self) -> torch.Tensor:
        return self.x

    @torch.no_grad()
    def local_step(self) -> None:
        """Algorithm 2's local step (:class:`NesterovLocalSteps`), with line a) if it is due."""
        self.nesterov.step(self._take_pull())

    @torch.no_grad()
    def apply_pull(self, fragment: Fragment) -> None:
        self.x[fragment.lo:fragment.hi].sub_(self._pull[fragment.lo:fragment.hi])
        self.nesterov.move_to_look_ahead()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "x": self.x.clone(), "v": self.v.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.x.copy_(state["x"])
        self.v.copy_(state["v"])
