"""shoal's synchronous-family strategies in a Hugging Face Accelerate loop.

Used the way ``accelerate.local_sgd.LocalSGD`` is: two lines in the loop you have::

    with Coupling(accelerator, model, optimizer, "diloco", tau=8) as coupling:
        for x, y in loader:
            accelerator.backward(loss_fn(model(x), y))
            optimizer.step()
            coupling.step()  # the strategy's exchange, when its schedule says so
            optimizer.zero_grad()

Inside the block the model's DDP does not all-reduce gradients (its ``no_sync``); the
strategy exchanges what it exchanges (DiLoCo's pseudo-gradients, streamed and compressed
as its options say; EASGD's elastic pull; local SGD's average) on the process group
Accelerate initialised. When the block ends, every rank holds the strategy's trained model
(DiLoCo's global model, EASGD's center). ``"sync"`` leaves Accelerate's DDP alone.
The strategy's state, every rank's own, is saved and restored with Accelerate's
``save_state`` / ``load_state`` (the coupling registers itself for checkpointing).
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
from torch import nn

import shoal
from shoal.errors import ShoalError
from shoal.integrations.coupling import Coupled, check_strategy

try:
    from accelerate import Accelerator, DistributedType
except ImportError as exc:  # the extra is not installed
    raise ShoalError("shoal.integrations.accelerate needs Accelerate: "
                     "pip install 'shoal[accelerate]'") from exc

#: Accelerate's setups whose model is one replica a process (no DeepSpeed, FSDP, XLA).
_REPLICATED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class Coupling(Coupled):
    """A shoal strategy coupling the processes of an Accelerate job.

    Args:
        accelerator: The job's ``accelerate.Accelerator``.
        model: The model ``accelerator.prepare`` returned (DDP-wrapped when distributed).
        optimizer: The optimizer ``accelerator.prepare`` returned.
        strategy: ``"sync"``, ``"local-sgd"``, ``"easgd"`` or ``"diloco"`` (or a registered
            synchronous strategy).
        **options: The strategy's options, by field name (``tau=8``, ``fragments=2``,
            ``overlap_steps=1``, ``outer_precision="int4"``, ``alpha=0.5``).

    Raises:
        ShoalError: An unknown strategy or option; one that needs parameter servers or
            takes its local step itself (``eamsgd``); ``tau="auto"`` (it needs every step's
            loss); gradient accumulation; an Accelerate setup that is not one replica a
            process (DeepSpeed, FSDP, XLA); a process group whose ranks are not
            Accelerate's.
    """

    def __init__(self, accelerator: Accelerator, model: nn.Module,
                 optimizer: torch.optim.Optimizer, strategy: str = "diloco",
                 **options: Any) -> None:
        _check_setup(accelerator, strategy, options)
        comm = shoal.init(device=accelerator.device.type, threads=torch.get_num_threads())
        _check_ranks(accelerator, comm.rank, comm.world_size)
        super().__init__(strategy, accelerator.unwrap_model(model), optimizer, comm, options)
        self.accelerator, self.model = accelerator, model
        self._held: contextlib.AbstractContextManager[Any] | None = None
        accelerator.register_for_checkpointing(self)

    def __enter__(self) -> Coupling:
        if self.strategy is not None and isinstance(self.model, nn.parallel.DistributedDataParallel):
            self._held = self.model.no_sync()  # the strategy, not DDP, couples the replicas
            self._held.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if kind is None:
                self.finish()
        finally:
            if self._held is not None:
                self._held.__exit__(kind, value, tb)
                self._held = None


def _check_setup(accelerator: Accelerator, strategy: str, options: dict[str, Any]) -> None:
    """Refuse, in one line, what a coupling cannot run faithfully."""
    if accelerator.distributed_type not in _REPLICATED:
        raise ShoalError(f"a shoal coupling needs one model replica a process (CPUs or GPUs), "
                         f"not Accelerate's {accelerator.distributed_type}")
    if accelerator.gradient_accumulation_steps > 1:
        raise ShoalError("a shoal coupling counts every optimizer step: leave Accelerate's "
                         "gradient_accumulation_steps at 1")
    check_strategy(strategy, options)


def _check_ranks(accelerator: Accelerator, rank: int, world: int) -> None:
    """Refuse a job whose ranks are not Accelerate's (a process Accelerate takes for a job
    of one, whose exchanges would go nowhere)."""
    if (rank, world) == (accelerator.process_index, accelerator.num_processes):
        return
    hint = " (without GPUs: Accelerator(cpu=True))" if accelerator.num_processes == 1 else ""
    raise ShoalError(f"the launcher made this process rank {rank} of {world}, Accelerate "
                     f"process {accelerator.process_index} of {accelerator.num_processes}"
                     f"{hint}")
