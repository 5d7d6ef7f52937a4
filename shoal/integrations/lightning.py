"""shoal's synchronous-family strategies as Lightning strategies, for the ``Trainer`` and for
Fabric, on Lightning's own launcher.

One argument in the ``Trainer`` you have::

    trainer = Trainer(accelerator="cpu", devices=2,
                      strategy=ShoalStrategy("diloco", tau=8))  # or fragments=2, outer_precision="int4"
    trainer.fit(model, loader)  # every process ends with DiLoCo's global model

and in Fabric, one argument and one call after the loop::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ShoalFabricStrategy("diloco", tau=8))
    ...  # fabric.setup(model, optimizer), fabric.backward(loss), optimizer.step()
    fabric.strategy.finish()  # every process holds the trained model

Both are Lightning's DDP strategy underneath: its launcher (``python train.py`` starts the
other processes), its process group, its device placement. ``"sync"`` is that DDP strategy
unchanged. Every other strategy leaves the model unwrapped (no DDP, so no gradient
all-reduce, no buffer broadcast) and runs after each ``optimizer.step()`` on Lightning's
process group: DiLoCo's pseudo-gradients (streamed and compressed as its options say),
EASGD's elastic pull, local SGD's average. At the fit's end (Fabric: ``finish()``) the
round in progress closes and every rank's model becomes the trained one (DiLoCo's global
model, EASGD's center). Validation inside a fit sees each rank's own replica.

Checkpoints: each ``trainer.save_checkpoint`` (``ModelCheckpoint`` too) and ``fabric.save``
gathers every rank's strategy state, model and optimizer (replicas drift between
exchanges) under the key ``"shoal"`` of the one file rank 0 writes; ``fit(ckpt_path=...)``
and ``fabric.load`` put back each rank's own.

Data: Lightning's ``DistributedSampler`` is kept, not shoal's sharding. Lightning injects
it into every loader (training, validation, test) and pads it, so every rank takes the
same number of steps: what a strategy that meets every ``tau`` steps needs. shoal's
sharding (contiguous slices of one seeded permutation, ``Strategy.batches``) iterates a
dataset, not a ``Sampler``; putting it in would take the user's loaders apart. The
strategies' arithmetic does not depend on which rows a rank reads, only on every rank
stepping together.

Refused in one line: the strategies with parameter servers (the asynchronous family:
shoal must lay out their processes), ``eamsgd`` (it takes its local step itself),
``elastic`` (shoal must supervise the processes), ``tau="auto"``, more than one optimizer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import shoal
from shoal.errors import ShoalError
from shoal.integrations.coupling import Coupled, check_strategy

try:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # the extra is not installed
    raise ShoalError("shoal.integrations.lightning needs Lightning: "
                     "pip install 'shoal[lightning]'") from exc

#: Where a checkpoint keeps every rank's coupling state.
KEY = "shoal"


def _couple(name: str, options: dict[str, Any], model: nn.Module,
            optimizers: list[torch.optim.Optimizer], device: torch.device, rank: int,
            world: int, per_node: int) -> Coupled:
    """The coupling of ``model`` and its one optimizer on Lightning's process group (not
    ``"sync"``: Lightning's DDP couples its replicas).

    Raises:
        ShoalError: Not one optimizer, or ranks that are not Lightning's.
    """
    if len(optimizers) != 1:
        raise ShoalError(f"a shoal strategy couples one optimizer, this model has "
                         f"{len(optimizers)}")
    # Lightning's launcher does not export a node's processes, which rank numbers need.
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(per_node))
    comm = shoal.init(device=device.type, threads=torch.get_num_threads())
    if (comm.rank, comm.world_size) != (rank, world):
        raise ShoalError(f"the launcher made this process rank {comm.rank} of "
                         f"{comm.world_size}, Lightning rank {rank} of {world}")
    return Coupled(name, model, optimizers[0], comm, options)


class ShoalStrategy(DDPStrategy):
    """A shoal strategy for ``lightning.pytorch.Trainer(strategy=...)``.

    Args:
        strategy: ``"sync"`` (Lightning's DDP), ``"local-sgd"``, ``"easgd"`` or ``"diloco"``
            (or a registered synchronous strategy).
        **options: The strategy's options, by field name (``tau=8``, ``fragments=2``,
            ``overlap_steps=1``, ``outer_precision="int4"``, ``alpha=0.5``).

    Raises:
        ShoalError: An unknown strategy or option; one with parameter servers, ``eamsgd``,
            ``elastic`` or ``tau="auto"``; at ``fit``, a module with more than one optimizer.
    """

    def __init__(self, strategy: str = "diloco", **options: Any) -> None:
        check_strategy(strategy, options)
        super().__init__()
        self.name, self.options = strategy, options
        #: The coupling of the fit in progress (or last ended); ``None`` before a fit and
        #: for ``"sync"``.
        self.coupled: Coupled | None = None

    def configure_ddp(self) -> None:
        """DDP for ``"sync"``; else the model stays unwrapped: the strategy, not DDP,
        couples the replicas."""
        if self.name == "sync":
            super().configure_ddp()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.name != "sync":
            self.coupled = _couple(self.name, self.options, self.lightning_module,
                                   self.optimizers, self.root_device, self.global_rank,
                                   self.world_size, self.num_processes)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | nn.Module | None = None,
                       **kwargs: Any) -> Any:
        """The optimizer's step (Lightning's), then the strategy's (its exchange, when its
        schedule says so)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.coupled is not None:
            self.coupled.step()
        return output

    def on_train_end(self) -> None:
        """Every rank's model becomes the trained one."""
        super().on_train_end()
        if self.coupled is not None:
            self.coupled.finish()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Lightning's checkpoint with every rank's coupling state under ``"shoal"``. A
        collective, as ``trainer.save_checkpoint`` is."""
        if self.coupled is not None:
            checkpoint = {**checkpoint, KEY: self.coupled.state_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Lightning's optimizer state (rank 0's), then this rank's own model, optimizer and
        strategy state (after the strategy was made: it starts every rank from rank 0's
        model)."""
        super().load_optimizer_state_dict(checkpoint)
        if self.coupled is not None and KEY in checkpoint:
            self.coupled.load_state_dict(checkpoint[KEY])


class _NothingHeld(_BackwardSyncControl):
    """``fabric.no_backward_sync`` on an unwrapped model: no all-reduce to hold back."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class ShoalFabricStrategy(FabricDDPStrategy):
    """A shoal strategy for ``lightning.fabric.Fabric(strategy=...)``.

    Set the model and its optimizer up together (``fabric.setup(model, optimizer)``); call
    :meth:`finish` (``fabric.strategy.finish()``) after the loop.

    Args:
        strategy: ``"sync"`` (Lightning's DDP), ``"local-sgd"``, ``"easgd"`` or ``"diloco"``
            (or a registered synchronous strategy).
        **options: The strategy's options, by field name (``tau=8``, ``fragments=2``,
            ``overlap_steps=1``, ``outer_precision="int4"``).

    Raises:
        ShoalError: An unknown strategy or option; one with parameter servers, ``eamsgd``,
            ``elastic`` or ``tau="auto"``; at setup, not one optimizer, or the optimizer set
            up apart from its model.
    """

    def __init__(self, strategy: str = "diloco", **options: Any) -> None:
        check_strategy(strategy, options)
        super().__init__()
        self.name, self.options = strategy, options
        #: The coupling of the model set up last; ``None`` before ``fabric.setup`` and for
        #: ``"sync"``.
        self.coupled: Coupled | None = None
        if strategy != "sync":
            self._backward_sync_control = _NothingHeld()

    def setup_module_and_optimizers(
            self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
            scheduler: Any = None) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        """The model and its one optimizer coupled (``"sync"``: the model in DDP)."""
        if self.name == "sync":
            return super().setup_module_and_optimizers(module, optimizers, scheduler)
        self.coupled = _couple(self.name, self.options, module, optimizers, self.root_device,
                               self.global_rank, self.world_size, self.num_processes)
        return module, optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """DDP for ``"sync"``; else the model stays unwrapped."""
        return super().setup_module(module) if self.name == "sync" else module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.name != "sync":
            raise ShoalError("a shoal strategy couples a model and its optimizer: set them up "
                             "together, fabric.setup(model, optimizer)")
        return super().setup_optimizer(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer's step, then the strategy's (its exchange, when its schedule says
        so)."""
        output = super().optimizer_step(optimizer, **kwargs)
        if self.coupled is not None:
            self.coupled.step()
        return output

    def finish(self) -> None:
        """After the loop, on every rank: close the round in progress and give every rank's
        model the trained one (DiLoCo's global model, EASGD's center)."""
        if self.coupled is not None:
            self.coupled.finish()

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Fabric's checkpoint with every rank's coupling state under ``"shoal"``. A
        collective, as ``fabric.save`` is."""
        if self.coupled is not None:
            state = {**state, KEY: self.coupled.state_dict()}
        super().save_checkpoint(path, state, storage_options, filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Fabric's restore of ``state`` (rank 0's model and optimizer), then this rank's own
        model, optimizer and strategy state."""
        remainder = super().load_checkpoint(path, state, strict, weights_only)
        if self.coupled is not None and isinstance(state, dict) and state and KEY in remainder:
            self.coupled.load_state_dict(remainder.pop(KEY))
        return remainder
