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

import torch
from torch import nn

from shoal.core import FlatParams, Handle
from shoal.errors import ShoalError
from shoal.strategies.averaging import ModelCopy, average_buffers
from shoal.strategies.base import PeriodicOptions, PeriodicStrategy
from shoal.strategies.communication import Exchange, Pattern
from shoal.strategies.period import first_period
from shoal.strategies.registry import register

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
    vector in this order."""
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
        return Pattern(Exchange.ALL_REDUCE, "elastic pulls", every=first_period(options.tau),
                       hidden=options.overlap)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm,
                 options: ElasticOptions | None = None) -> None:
        super().__init__(model, optimizer, comm, options)
        self.alpha = self.options.moving_rate(comm.world_size)
        order = parameter_order(model, optimizer)
        self.flat = FlatParams(order)
        self.center = ModelCopy(model, order)  # x~, laid out as self.flat
        comm.broadcast(self.center.vector, src=0, name="center")  # one center to start from
        self.flat.unpack(self.center.vector)  # and x^i = x~ (the algorithms' initialization)
        self._pull = torch.zeros_like(self.center.vector)  # d = alpha (x - x~): line a), pending
        self._pull_due = False
        self._sum = torch.zeros_like(self.center.vector)  # every worker's d, being summed: b)
        self._pending: Handle | None = None

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
        """Line a)'s ``d``, decided at the last exchange, if it has not been applied yet."""
        if not self._pull_due:
            return None
        self._pull_due = False
        return self._pull

    @torch.no_grad()
    def exchange(self) -> None:
        """Lines a) and b) of the next step, from the worker's x after this one."""
        self._finish()
        torch.sub(self.worker_vector(), self.center.vector, out=self._pull).mul_(self.alpha)
        self._pull_due = True
        self._sum.copy_(self._pull)
        self._pending = self.comm.all_reduce_async(self._sum, "sum", "elastic")
        if not self.options.overlap:
            self._finish()

    @torch.no_grad()
    def _finish(self) -> None:
        """Line b) for every worker: add the sum of their pulls to the center."""
        if self._pending is not None:
            self.center.vector.add_(self._pending.wait())
            self._pending = None

    def end_epoch(self, epoch: int) -> None:
        self._finish()
        self.comm.broadcast(self.center.vector, src=0, name="center")
        average_buffers(self.model, self.comm)

    def state_dict(self) -> dict:
        self._finish()
        return {**super().state_dict(), "center": self.center.vector.clone(),
                "pull": self._pull.clone(), "pull_due": self._pull_due}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.center.vector.copy_(state["center"])
        if "pull" in state:
            self._pull.copy_(state["pull"])
            self._pull_due = bool(state["pull_due"])


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
    (laid out as ``flat``: :func:`parameter_order`) at every step, so learning-rate schedules
    apply exactly.
    """

    def __init__(self, flat: FlatParams, optimizer: torch.optim.Optimizer) -> None:
        self.flat, self.optimizer = flat, optimizer
        self.x = flat.pack().clone()  # x^i; the parameters hold x^i + delta v^i
        self.v = torch.zeros_like(self.x)  # v^i
        self._grad = torch.zeros_like(self.x)
        self._grad_views = flat.views(self._grad)
        bounds, start = [], 0
        for group in optimizer.param_groups:
            size = sum(p.numel() for p in group["params"])
            bounds.append((start, start + size))
            start += size
        self._groups = bounds  # each optimizer group's slice of x, v and the gradient

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
        for (lo, hi), group in zip(self._groups, self.optimizer.param_groups, strict=True):
            g, v = self._grad[lo:hi], self.v[lo:hi]
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
        for (lo, hi), group in zip(self._groups, self.optimizer.param_groups, strict=True):
            look_ahead[lo:hi].add_(self.v[lo:hi], alpha=group["momentum"])
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

    def state_dict(self) -> dict:
        return {**super().state_dict(), "x": self.x.clone(), "v": self.v.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.x.copy_(state["x"])
        self.v.copy_(state["v"])
