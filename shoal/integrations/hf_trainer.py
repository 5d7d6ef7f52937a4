"""shoal's synchronous-family strategies in a Hugging Face ``Trainer``.

Two changes to a Trainer script: ``ShoalTrainer`` for ``Trainer``, and a ``ShoalCallback``::

    trainer = ShoalTrainer(model=model, args=args, train_dataset=train,
                           callbacks=[ShoalCallback("diloco", tau=8)])
    trainer.train()

The callback is an Accelerate :class:`~shoal.integrations.accelerate.Coupling` on the
Trainer's own ``accelerator``: from ``on_train_begin`` the model's DDP does not all-reduce
gradients (its ``no_sync``), ``on_optimizer_step`` (right after ``optimizer.step()``) runs the
strategy's exchange when its schedule says so, and ``on_train_end`` gives every rank the
trained model (DiLoCo's global model, EASGD's center). ``"sync"`` leaves the Trainer's DDP
alone. ``ShoalTrainer`` hands the callback the Trainer, writes every rank's strategy state
into each checkpoint folder (``shoal_coupling.pt``) and puts it back on
``train(resume_from_checkpoint=...)``. The Trainer's own files in a checkpoint
(``model.safetensors``) hold rank 0's replica, and evaluation during training sees each
rank's own; the trained model is there once ``train()`` returns (``trainer.save_model()``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shoal.errors import ShoalError
from shoal.integrations.accelerate import Coupling

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint
except ImportError as exc:  # the extra is not installed
    raise ShoalError("shoal.integrations.hf_trainer needs transformers: "
                     "pip install 'shoal[transformers]'") from exc

#: The file, in each checkpoint folder, that holds every rank's strategy state.
STATE_FILE = "shoal_coupling.pt"

__all__ = ["STATE_FILE", "ShoalCallback", "ShoalTrainer"]


class ShoalCallback(TrainerCallback):
    """A shoal strategy coupling the processes of a :class:`ShoalTrainer`.

    Args:
        strategy: ``"sync"``, ``"local-sgd"``, ``"easgd"`` or ``"diloco"`` (or a registered
            synchronous strategy).
        **options: The strategy's options, by field name (``tau=8``, ``fragments=2``,
            ``overlap_steps=1``, ``outer_precision="int4"``, ``alpha=0.5``).

    Raises:
        ShoalError: When training begins: a plain ``Trainer`` (its DDP would all-reduce
            every step); ``gradient_accumulation_steps`` above 1;
            ``load_best_model_at_end`` (but for ``sync``); whatever
            :class:`~shoal.integrations.accelerate.Coupling` refuses (a strategy that needs
            parameter servers, ``eamsgd``, an unknown option, ``tau="auto"``, DeepSpeed or
            FSDP); a resumed checkpoint without shoal's state.
    """

    def __init__(self, strategy: str = "diloco", **options: Any) -> None:
        self.strategy, self.options = strategy, options
        self.coupling: Coupling | None = None
        self._trainer: ShoalTrainer | None = None
        self._resume: str | None = None
        self._held = False

    def bind(self, trainer: ShoalTrainer, resume: str | None) -> None:
        """Take the trainer about to train, and the checkpoint it resumes from (``None``
        for a fresh start). :meth:`ShoalTrainer.train` calls it."""
        self._trainer, self._resume = trainer, resume

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        """Couple the prepared model and optimizer; put a resumed checkpoint's state back."""
        trainer = self._trainer
        if trainer is None:
            raise ShoalError("ShoalCallback needs ShoalTrainer in place of Trainer (a plain "
                             "Trainer's DDP all-reduces every step's gradients)")
        if args.gradient_accumulation_steps > 1:
            raise ShoalError("a shoal coupling counts every optimizer step: leave the "
                             "Trainer's gradient_accumulation_steps at 1")
        if args.load_best_model_at_end and self.strategy != "sync":
            raise ShoalError("load_best_model_at_end would load rank 0's replica, not the "
                             "strategy's trained model: leave it off")
        coupling = Coupling(trainer.accelerator, trainer.model_wrapped, trainer.optimizer,
                            self.strategy, **self.options)
        if self._resume is not None:
            coupling.load_state_dict(_read(self._resume, trainer))
        self.coupling = coupling
        coupling.__enter__()  # DDP's no_sync, held until the end of training
        self._held = True

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                          control: TrainerControl, **kwargs: Any) -> None:
        """Right after ``optimizer.step()``: the strategy's exchange, on its schedule."""
        if self.coupling is not None:
            self.coupling.step()

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Close the strategy's round and give every rank the trained model (a collective:
        every rank calls it); DDP syncs gradients again."""
        if self.coupling is not None and self._held:
            self._held = False
            self.coupling.__exit__(None, None, None)

    def release(self, error: BaseException) -> None:
        """After ``train()`` failed: let DDP sync gradients again, without the collective
        that :meth:`on_train_end` runs (the other ranks may be gone)."""
        if self.coupling is not None and self._held:
            self._held = False
            self.coupling.__exit__(type(error), error, error.__traceback__)

    def save(self, folder: str, write: bool) -> None:
        """Gather every rank's strategy state (a collective) and, where ``write``, save it
        in ``folder``."""
        if self.coupling is None:
            return
        state = self.coupling.state_dict()
        if write:
            os.makedirs(folder, exist_ok=True)
            torch.save(state, os.path.join(folder, STATE_FILE))


class ShoalTrainer(Trainer):
    """A ``transformers.Trainer`` whose processes a :class:`ShoalCallback` couples.

    Everything is the Trainer's own, but three things: ``train()`` hands the callback the
    Trainer (it couples the prepared model and optimizer), each checkpoint gets every rank's
    strategy state, and resuming puts it back.

    Raises:
        ShoalError: From ``train()``: no ``ShoalCallback`` among the callbacks, or more than
            one.
    """

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> TrainOutput:
        """The Trainer's ``train``, coupled by the callback. Its arguments are the Trainer's;
        ``resume_from_checkpoint`` also restores every rank's strategy state."""
        callback = self._shoal_callback()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        callback.bind(self, resume_from_checkpoint
                      if isinstance(resume_from_checkpoint, str) else None)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as error:
            callback.release(error)
            raise

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any, *args: Any,
                         **kwargs: Any) -> None:
        """The Trainer's checkpoint, with every rank's strategy state in the same folder
        (written first, so that a push to the Hub or a rotation sees it)."""
        folder = os.path.join(self._get_output_dir(trial=trial),
                              f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._shoal_callback().save(folder, self.args.should_save)
        super()._save_checkpoint(model, trial, *args, **kwargs)

    def _shoal_callback(self) -> ShoalCallback:
        found = [c for c in self.callback_handler.callbacks if isinstance(c, ShoalCallback)]
        if len(found) != 1:
            raise ShoalError(f"ShoalTrainer takes one ShoalCallback in its callbacks "
                             f"(callbacks=[ShoalCallback('diloco', tau=8)]), not {len(found)}")
        return found[0]


def _read(checkpoint: str, trainer: Trainer) -> dict[str, Any]:
    """The strategy state saved in ``checkpoint``, onto this process's device."""
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        raise ShoalError(f"checkpoint {checkpoint} has no {STATE_FILE} (not saved by a "
                         "ShoalTrainer): resume from one that is")
    device = trainer.args.device  # "cpu:0" on CPUs, which torch.load does not take
    state: dict[str, Any] = torch.load(path, weights_only=True,
                                       map_location="cpu" if device.type == "cpu" else device)
    return state
