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
import torch.distributed as dist
from torch import nn

import shoal
from shoal.errors import ShoalError
from shoal.strategies import get_strategy, make_options
from shoal.strategies.easgd import ElasticAveragingMomentum

try:
    from accelerate import Accelerator, DistributedType
except ImportError as exc:  # the extra is not installed
    raise ShoalError("shoal.integrations.accelerate needs Accelerate: "
                     "pip install 'shoal[accelerate]'") from exc

#: Accelerate's setups whose model is one replica a process (no DeepSpeed, FSDP, XLA).
_REPLICATED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class _StepTaken:
    """The user's optimizer as the strategy sees it: the loop already called its ``step()``
    (the Accelerate way), so the strategy's local step does not take it again. All else
    (its groups, their learning rates, its state) is the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self, closure: Any = None) -> None:
        """Nothing: the loop's ``optimizer.step()`` took this step."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class Coupling:
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
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.name, self.steps = strategy, 0
        self.comm = shoal.init(device=accelerator.device.type, threads=torch.get_num_threads())
        _check_ranks(accelerator, self.comm.rank, self.comm.world_size)
        self.inner = accelerator.unwrap_model(model)
        self.strategy = None if strategy == "sync" else shoal.strategy(
            strategy, self.inner, _StepTaken(optimizer), self.comm, **options)  # type: ignore[arg-type]
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

    def step(self) -> None:
        """After ``optimizer.step()``: count the step, and exchange when the strategy's
        schedule says so (EASGD's pull lands here too)."""
        self.steps += 1
        if self.strategy is not None:
            self.strategy.step()

    @torch.no_grad()
    def finish(self) -> None:
        """Close the strategy's round in progress (every exchange in flight applied) and give
        every rank's model the trained one (DiLoCo's global model, EASGD's center). The
        block's end calls it."""
        if self.strategy is None:
            return
        self.strategy.end_epoch(self.steps)
        trained = self.strategy.eval_module
        if trained is not self.inner:
            for mine, theirs in zip(self.inner.parameters(), trained.parameters(), strict=True):
                mine.copy_(theirs)

    # -- checkpoints (accelerator.save_state / load_state) --------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's strategy state, gathered for the one file Accelerate writes: where
        replicas drift (all but ``sync``) each rank's model and optimizer too, which
        Accelerate saves of rank 0 only. A collective: Accelerate calls it on every rank."""
        if self.strategy is None:
            return {"strategy": self.name, "steps": self.steps}
        own = {"strategy": self.strategy.state_dict(), "model": self.inner.state_dict(),
               "optimizer": self.optimizer.state_dict()}
        ranks: list[Any] = [own]
        if self.comm.world_size > 1:
            ranks = [None] * self.comm.world_size
            with self.comm.track("all_gather", "strategy state"):
                dist.all_gather_object(ranks, own)
        return {"strategy": self.name, "steps": self.steps, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back this rank's part of what :meth:`state_dict` gathered.

        Raises:
            ShoalError: The state is another strategy's, or of another number of processes.
        """
        if state.get("strategy") != self.name:
            raise ShoalError(f"the saved coupling state is {state.get('strategy')!r}'s, this "
                             f"coupling's strategy is {self.name!r}")
        self.steps = int(state["steps"])
        if self.strategy is None:
            return
        ranks = state["ranks"]
        if len(ranks) != self.comm.world_size:
            raise ShoalError(f"the saved coupling state is of {len(ranks)} processes, this job "
                             f"has {self.comm.world_size}: resume on {len(ranks)}")
        own = ranks[self.comm.rank]
        self.inner.load_state_dict(own["model"])
        self.optimizer.load_state_dict(own["optimizer"])
        self.strategy.load_state_dict(own["strategy"])


def _check_setup(accelerator: Accelerator, strategy: str, options: dict[str, Any]) -> None:
    """Refuse, in one line, what a coupling cannot run faithfully."""
    if accelerator.distributed_type not in _REPLICATED:
        raise ShoalError(f"a shoal coupling needs one model replica a process (CPUs or GPUs), "
                         f"not Accelerate's {accelerator.distributed_type}")
    if accelerator.gradient_accumulation_steps > 1:
        raise ShoalError("a shoal coupling counts every optimizer step: leave Accelerate's "
                         "gradient_accumulation_steps at 1")
    cls = get_strategy(strategy)
    if cls.topology(cls.Options(), 2).servers:
        raise ShoalError(f"strategy {strategy} needs shoal to lay out its processes (parameter "
                         "servers beside the workers): run it with shoal train or shoal run")
    if issubclass(cls, ElasticAveragingMomentum):
        raise ShoalError("eamsgd takes its local step itself (Nesterov momentum in x and v), "
                         "which the loop's optimizer.step() would take twice: use easgd, or "
                         "shoal's own loop")
    make_options(cls, options)  # an unknown option or a value out of range: before joining
    if options.get("tau") is not None and isinstance(options["tau"], str):
        raise ShoalError(f"tau={options['tau']!r} adapts to every step's loss, which a coupling "
                         "does not see: give a number of steps")


def _check_ranks(accelerator: Accelerator, rank: int, world: int) -> None:
    """Refuse a job whose ranks are not Accelerate's (a process Accelerate takes for a job
    of one, whose exchanges would go nowhere)."""
    if (rank, world) == (accelerator.process_index, accelerator.num_processes):
        return
    hint = " (without GPUs: Accelerator(cpu=True))" if accelerator.num_processes == 1 else ""
    raise ShoalError(f"the launcher made this process rank {rank} of {world}, Accelerate "
                     f"process {accelerator.process_index} of {accelerator.num_processes}"
                     f"{hint}")
