"""The Strategy interface: how workers couple.

A strategy owns everything that crosses between workers during training. In a loop of your
own, the calls you would write anyway are all it needs::

    for x, y in strategy.batches(data.train, batch_size=16, epoch=epoch):  # this worker's share
        loss = loss_fn(strategy.module(x), y)   # forward (DDP-wrapped for ``sync``)
        strategy.backward(loss)                 # weighted for uneven shares of a batch
        strategy.step()                         # instead of optimizer.step()
        strategy.zero_grad()

:meth:`Strategy.batches` hands out this worker's rows of every global batch, in the order
``shoal train`` reads them, tells :meth:`Strategy.backward` how to weigh uneven last batches
and calls :meth:`Strategy.end_epoch` after the epoch's last batch. :attr:`Strategy.eval_module`
is the model to evaluate and save (the elastic center for EASGD). Options are a dataclass;
its fields become command-line flags (``tau`` becomes ``--tau``), so a new strategy needs
nothing but its file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.core.comm import Comm
from shoal.data.base import num_rows, take_rows
from shoal.data.sharding import EpochPlan
from shoal.errors import ShoalError
from shoal.schema import check_bounds, check_value, field_kind, flag_name
from shoal.strategies.capabilities import SettingsOptions, ValidatedOptions, WorkerCheckedOptions
from shoal.strategies.communication import Pattern
from shoal.strategies.topology import Topology


@dataclasses.dataclass
class NoOptions:
    """A strategy without options."""


def check_options(options: Any, workers: int | None) -> None:
    """Check every number option is in range, for every strategy, new ones too (floats
    finite, as ``nan`` slips through checks such as ``x <= 0``, and within float32; ints
    within int64), then run the options' own checks: ``validate()``
    (:class:`ValidatedOptions`), and ``check_workers(n)`` once the number of workers is
    known (:class:`WorkerCheckedOptions`)."""
    if dataclasses.is_dataclass(options):
        for f in dataclasses.fields(options):
            check_bounds(getattr(options, f.name, None), flag_name(f.name))
    if isinstance(options, ValidatedOptions):
        options.validate()
    if isinstance(options, WorkerCheckedOptions) and workers is not None:
        options.check_workers(workers)


class Strategy:
    """How workers couple; the base class takes plain local steps with no communication.

    Made by `shoal.strategy` (or ``shoal train --strategy``), it takes the calls a training
    loop makes anyway: `batches` for this worker's rows, `module` for forward and backward,
    `backward`, `step` instead of ``optimizer.step()``, `zero_grad`; `eval_module` is the
    model to evaluate and save. A new strategy subclasses it, sets `name` (the
    ``--strategy`` value) and `Options` (a dataclass of its settings, fields with
    ``metadata={"help": ...}``: each becomes a flag), registers itself with
    `shoal.register` and overrides the hooks it needs (docs/write-a-strategy.md).

    Args:
        model: The model this worker trains (the same initial weights on every worker).
        optimizer: The optimizer over ``model``'s parameters.
        comm: The job's `shoal.core.comm.Comm` (`shoal.init`).
        options: An instance of `Options`; default its defaults.

    Raises:
        ShoalError: An option out of its range, or one that does not fit the number of
            workers.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: True when every rank holds identical parameters and optimizer state after each step,
    #: so checkpoints keep one copy; False when replicas drift (local SGD, EASGD, ...).
    replicas_in_sync: ClassVar[bool] = True
    #: Whether the optimizer's momentum moves the model (async-sgd's server applies none):
    #: ``--momentum auto`` then carries the whole step in the learning rate.
    applies_momentum: ClassVar[bool] = True

    @classmethod
    def asynchronous_groups(cls, options: Any, workers: int) -> int:
        """How many groups of workers update the model asynchronously to each other (1: the
        workers move in step). ``--momentum auto`` lowers the explicit momentum by the
        implicit momentum ``1 - 1/g`` such asynchrony adds (Omnivore)."""
        return 1

    @classmethod
    def servers(cls, options: Any) -> int:
        """Parameter-server processes this strategy runs beside its workers (none)."""
        return 0

    @classmethod
    def topology(cls, options: Any, workers: int) -> Topology:
        """How a job of ``workers`` workers lays out its processes: every rank a worker,
        all of them one group (the job's process group)."""
        return Topology(workers)

    @classmethod
    def communication(cls, options: Any, workers: int) -> Pattern | None:
        """What ``workers`` workers with ``options`` exchange, how often and with whom
        (:class:`~shoal.strategies.communication.Pattern`): what the cost model prices.
        ``None``: no pattern to price (nothing crosses a network)."""
        return None

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 options: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.comm = comm
        self.options = options if options is not None else self.Options()
        check_options(self.options, comm.world_size)
        self.steps = 0  # optimizer steps taken through this strategy
        #: (rows on this worker, rows in the global batch) of the batch being trained on;
        #: set by :meth:`batches` (or by you, when your own shards of a batch differ in size).
        self.batch_share: tuple[int, int] | None = None
        #: float16 training's gradient scaler (:class:`~shoal.strategies.precision.MixedPrecision`
        #: sets it): :meth:`backward` multiplies the loss by its scale.
        self.scaler: torch.amp.GradScaler | None = None

    # -- the data -------------------------------------------------------------------------
    def batches(self, data: Any, batch_size: int, epoch: int = 0, *, seed: int = 0,
                global_batch: int | None = None) -> Iterator[Any]:
        """This worker's rows of every global batch of epoch ``epoch``, as ``shoal train``
        reads them; after the last one, `end_epoch`.

        Every worker draws the same seeded permutation of ``data`` and takes its contiguous
        slice of each global batch; nothing is dropped, so the last batch may be smaller and
        split unevenly, which `backward` weighs.

        Args:
            data: A shoal ``Split`` (``dataset.train``), a tuple of tensors or a map-style
                ``torch.utils.data.Dataset``.
            batch_size: Rows per worker in a global batch.
            epoch: The epoch, which picks the permutation.
            seed: The permutations' seed, the same on every worker.
            global_batch: Rows in a global batch; default ``batch_size`` x workers.

        Yields:
            This worker's rows of each global batch (the type ``data``'s rows have), on the
                strategy's device.
        """
        world, rank = self.comm.world_size, self.comm.rank
        plan = EpochPlan(num_rows(data), global_batch or batch_size * world, world, seed)
        perm = plan.permutation(epoch)
        device = self.comm.device
        try:
            for step in range(plan.steps_per_epoch):
                idx, n_global = plan.local(perm, step, rank)
                batch = take_rows(data, idx)
                if device.type != "cpu":
                    batch = type(batch)(t.to(device, non_blocking=True) for t in batch)
                self.batch_share = (len(idx), n_global)
                yield batch
        finally:
            self.batch_share = None
        self.end_epoch(epoch)

    # -- the training step ------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The module to run forward and backward through (DDP-wrapped for ``sync``)."""
        return self.model

    @property
    def eval_module(self) -> nn.Module:
        """The model to evaluate, report and save (the elastic center for EASGD)."""
        return self.model

    def loss_weight(self, n_local: int, n_global: int) -> float:
        """Factor applied to this rank's mean loss before backward (1 by default)."""
        return 1.0

    def weighted(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times :meth:`loss_weight` of the current :attr:`batch_share`, if any, and
        times the :attr:`scaler`'s scale, if any."""
        if self.batch_share is not None:
            weight = self.loss_weight(*self.batch_share)
            loss = loss if weight == 1.0 else loss * weight
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def no_sync(self, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """A context in which backward passes only accumulate gradients, for gradient
        accumulation: the next backward outside communicates them all.

        DDP's ``no_sync`` for ``sync`` and ``groups``; the strategies that communicate in
        `step` have nothing to hold back.

        Args:
            enabled: Whether to hold the gradients back (``False``: a context that does
                nothing).

        Returns:
            The context manager.
        """
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate this worker's mean loss over its share of the batch.

        Weighted for an uneven share of the global batch (see `batches`), and scaled for
        float16 training.

        Args:
            loss: This worker's mean loss over its rows of the batch.
        """
        self.weighted(loss).backward()

    def step(self) -> None:
        """Update the parameters (and communicate, when this strategy's schedule says so)."""
        self.local_step()
        self.steps += 1

    def local_step(self) -> None:
        """This worker's own update, from its own gradients: the optimizer's step."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Clear the gradients (``optimizer.zero_grad(set_to_none=True)``)."""
        self.optimizer.zero_grad(set_to_none=True)

    def end_epoch(self, epoch: int) -> None:
        """Called once after each epoch, on every rank, before evaluation (`batches` calls
        it after the epoch's last batch).

        Args:
            epoch: The epoch that ended.
        """

    def regroup(self) -> None:
        """The job's group was re-formed without a lost worker (``--elastic``): its Comm now
        has the new rank and world size, and its collectives the new group. A strategy that
        holds something of the old group (DDP's process group) renews it here."""

    @property
    def stop_peers(self) -> Comm:
        """The ranks that stop after the same step on SIGTERM (they vote through this Comm):
        every rank of the job; an asynchronous worker stops alone (its Comm has no peers),
        a compute group's members together."""
        return self.comm

    def meets_after(self, step: int) -> bool:
        """Whether the workers met (exchanged) at the end of step ``step`` (just taken): a
        rank-wide vote (stopping on SIGTERM) rides on those steps without adding coupling."""
        return True

    def steps_uncounted(self) -> int:
        """Of the steps taken so far, how many (the last ones) no exchange has carried into
        the shared state yet, after a meeting (``--elastic`` counts the rest)."""
        return 0

    # -- checkpoints ------------------------------------------------------------------------
    def handover_state(self) -> dict[str, Any]:
        """What a worker that joins takes of this rank's state (``--elastic``): all of it,
        but what is this rank's own (error-feedback residuals)."""
        return self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """This rank's strategy state, saved per rank in checkpoints.

        Returns:
            Tensors, numbers and dicts of them (the base class: the steps taken).
        """
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what `state_dict` returned.

        Args:
            state: A `state_dict` of this strategy.
        """
        self.steps = int(state.get("steps", 0))

    def checkpoint_shared(self) -> dict[str, Any]:
        """What a checkpoint keeps once, from rank 0: ``"model"`` (:attr:`eval_module`'s
        parameters, what users load from ``checkpoint.pt``) and ``"optimizer"``.

        Called on rank 0 only, after :meth:`checkpoint_own`.
        """
        return {"model": self.eval_module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def checkpoint_own(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank: :meth:`state_dict` as ``"strategy"``, and
        where replicas drift (not :attr:`replicas_in_sync`) this rank's ``"model"`` and
        ``"optimizer"``. Called on every rank; keys ``rng``, ``aug_rng``, ``cuda_rng``,
        ``times``, ``bytes_sent``, ``epoch_sums`` and ``precision`` are the trainer's own.
        """
        own = {"strategy": self.state_dict()}
        if not self.replicas_in_sync:
            own["model"] = self.model.state_dict()
            own["optimizer"] = self.optimizer.state_dict()
        return own

    def restore_checkpoint(self, shared: dict[str, Any], own: dict[str, Any] | None) -> None:
        """Put back what :meth:`checkpoint_shared` and :meth:`checkpoint_own` saved; ``own``
        is ``None`` on a rank the checkpoint has no state of (in-sync replicas resumed on
        more workers: they all start from the shared model)."""
        in_sync = self.replicas_in_sync
        self.model.load_state_dict(shared["model"] if in_sync else own["model"])
        self.optimizer.load_state_dict(shared["optimizer"] if in_sync else own["optimizer"])
        if own is not None:
            self.load_state_dict(own["strategy"])


def option_fields(cls: type[Strategy]) -> list[dataclasses.Field]:
    """The dataclass fields of a strategy's options."""
    if not dataclasses.is_dataclass(cls.Options):
        raise ShoalError(f"strategy {cls.name!r}: Options must be a dataclass")
    return list(dataclasses.fields(cls.Options))


def make_options(cls: type[Strategy], values: dict[str, Any], workers: int | None = None) -> Any:
    """Build and check ``cls.Options`` from ``values``, naming any option it does not take.

    Each value must fit its field's annotation, as :class:`~shoal.config.TrainConfig`'s
    fields must (an ``int`` option takes no float, a ``float`` one takes ints and must be
    finite). With ``workers``, the checks that depend on the number of workers run too, so
    that a bad combination is caught before any worker starts.
    """
    known = {f.name for f in option_fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        flags = ", ".join(flag_name(u) for u in unknown)
        takes = ", ".join(flag_name(k) for k in sorted(known)) or "no options"
        raise ShoalError(f"strategy {cls.name} does not take {flags} (it takes {takes})")
    try:
        hints = typing.get_type_hints(cls.Options)
    except Exception:  # annotations that do not resolve here: the options' own checks remain
        hints = {}
    values = {k: check_value(v, hints[k], flag_name(k), kind=field_kind(cls.Options, k))
              if k in hints else v
              for k, v in values.items()}
    options = cls.Options(**values)
    check_options(options, workers)
    return options


def settings_of(cls: type[Strategy], values: dict[str, Any], workers: int) -> dict[str, Any]:
    """What the run's first line shows and ``config.json`` keeps of ``cls``'s options as a
    run of ``workers`` takes them, given or by default (``options.settings(workers)``: an
    elastic strategy's period and moving rate: :class:`SettingsOptions`); ``{}`` for a
    strategy without such."""
    options = make_options(cls, values)
    return options.settings(workers) if isinstance(options, SettingsOptions) else {}
