"""Whether a run is learning: a non-finite loss, a collapse to chance, a run that learned nothing.

Every strategy's records pass through the :class:`~shoal.train.recorder.Recorder` (a
synchronous run's rank 0, an asynchronous run's coordinator), which hands each step's loss and
each epoch's numbers to a :class:`Health`:

- A non-finite training loss stops the run at once (:meth:`Health.check_loss`, every step on
  the CPU, every ``--log-every`` steps on a GPU where a per-step check would wait for the
  device) with one line: the step (the launcher names the rank), the checkpoint kept (never
  overwritten by a non-finite state: the trainer and the coordinator check the parameters
  before writing) and what to try.
- A run whose training loss sits at chance (for C classes, at least :data:`CHANCE_SHARE` of
  ln C, the loss of predicting 1/C for every class) with accuracy at most
  :data:`CHANCE_ACCURACY` / C for :data:`COLLAPSE_EPOCHS` epochs after having done better has
  *collapsed* (momentum too high for the asynchrony, a learning rate past the edge): one line
  when seen, and the trainer stops (unless ``--allow-collapse``).
- A run whose last :data:`COLLAPSE_EPOCHS` epochs were at chance without ever doing better
  *learned nothing*.
- A run whose last :data:`COLLAPSE_EPOCHS` tested epochs each kept less than
  :data:`FALL_SHARE` of what its best test accuracy had gained over chance *fell back* (88%
  at epoch 7, 19.7% from epoch 30 to the end of 120: judged at the end, since a run may
  recover).

Each verdict goes into ``summary.json`` as ``"collapsed"`` and replaces the ``done:`` line;
``shoal train`` then exits with status 4 (``shoal.cli.EXIT_COLLAPSED``) unless
``--allow-collapse``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError

#: Epochs at chance that make a collapse (and, at the end, a run that learned nothing).
COLLAPSE_EPOCHS = 3
#: A training loss of at least this share of ln C is at chance ...
CHANCE_SHARE = 0.95
#: ... with an accuracy (training, and test where measured) of at most this many times 1/C.
CHANCE_ACCURACY = 1.5
#: An epoch did better than chance: a training loss below this share of ln C, or a test
#: accuracy of at least this many times 1/C.
BETTER_SHARE, BETTER_ACCURACY = 0.8, 2.0
#: A tested epoch fell back: its test accuracy kept less than this share of the best's gain
#: over chance (1/C).
FALL_SHARE = 0.5


class NonFiniteLoss(ShoalError):
    """The training loss became NaN or infinite: the run stops at once."""


@dataclass
class Health:
    """One run's watch over its epochs (``classes``: C, the number of classes)."""

    classes: int
    #: ``--allow-collapse``: a collapse is recorded, the run goes on.
    allow_collapse: bool = False
    better: bool = False  # some epoch did better than chance
    at_chance: int = 0  # epochs at chance in a row, up to the last
    since: int | None = None  # the first of them
    last: dict[str, float] = field(default_factory=dict)
    #: Said once, when the collapse is first seen.
    announced: bool = False
    best: tuple[float, int] = (0.0, 0)  # the best test accuracy, and its epoch
    fallen: int = 0  # tested epochs in a row, up to the last, that fell back from the best
    fallen_since: int | None = None

    @property
    def chance_loss(self) -> float:
        return math.log(self.classes)

    def check_loss(self, loss: float, step: int, epoch: int, lr: float, checkpoint: Path) -> None:
        """Raise :class:`NonFiniteLoss` (its one line; the launcher names the rank) when
        ``loss`` is not finite."""
        if math.isfinite(loss):
            return
        kept = f"{checkpoint} keeps the last good state" if checkpoint.exists() \
            else "no checkpoint holds it"
        raise NonFiniteLoss(
            f"training loss became {loss} at step {step} (epoch {epoch}); "
            f"{kept}; try a lower --lr (this step's was {lr:.3g}), --clip-grad-norm 1 or "
            "--warmup-epochs 1")

    def epoch(self, epoch: int, train_loss: float, train_acc: float, test_acc: float) -> str | None:
        """Take epoch ``epoch``'s numbers (``test_acc`` NaN where not tested); the one line
        to show when this epoch makes the run collapsed, else ``None``."""
        chance_acc = CHANCE_ACCURACY / self.classes
        tested = math.isfinite(test_acc)
        if train_loss >= CHANCE_SHARE * self.chance_loss and train_acc <= chance_acc \
                and (not tested or test_acc <= chance_acc):
            self.since = epoch if self.at_chance == 0 else self.since
            self.at_chance += 1
        else:
            self.at_chance, self.since = 0, None
            self.better = self.better or train_loss < BETTER_SHARE * self.chance_loss \
                or (tested and test_acc >= BETTER_ACCURACY / self.classes)
        self.last = {"epoch": epoch, "train_loss": train_loss, "train_accuracy": train_acc,
                     "test_accuracy": test_acc}
        if tested:
            self._watch_fall(epoch, test_acc)
        if not self.collapsed or self.announced:
            return None
        self.announced = True
        return self.line() + ("; going on (--allow-collapse)" if self.allow_collapse else
                              "; stopping (--allow-collapse goes on)")

    def _watch_fall(self, epoch: int, test_acc: float) -> None:
        """Keep the best test accuracy, and count the tested epochs since that fell back."""
        chance = 1 / self.classes
        if test_acc > self.best[0]:
            self.best = (test_acc, epoch)
        kept = FALL_SHARE * (self.best[0] - chance)
        if self.best[0] >= BETTER_ACCURACY * chance and test_acc - chance < kept:
            self.fallen_since = epoch if self.fallen == 0 else self.fallen_since
            self.fallen += 1
        else:
            self.fallen, self.fallen_since = 0, None

    @property
    def collapsed(self) -> bool:
        """Did better, then sat at chance for :data:`COLLAPSE_EPOCHS` epochs."""
        return self.better and self.at_chance >= COLLAPSE_EPOCHS

    @property
    def fell_back(self) -> bool:
        """Not at chance, but its last :data:`COLLAPSE_EPOCHS` tested epochs fell back."""
        return self.at_chance < COLLAPSE_EPOCHS and self.fallen >= COLLAPSE_EPOCHS

    @property
    def stop(self) -> bool:
        """Whether the trainer stops now (collapsed, not ``--allow-collapse``)."""
        return self.collapsed and not self.allow_collapse

    def verdict(self) -> dict[str, Any] | None:
        """``summary.json``'s ``"collapsed"``: collapsed, fell back, or learned nothing (the last
        :data:`COLLAPSE_EPOCHS` epochs at chance, never better); ``None`` for a run that
        learned."""
        if self.fell_back:
            return {"kind": "fell back", "since_epoch": self.fallen_since,
                    "best_test_accuracy": self.best[0], "best_epoch": self.best[1], **self.last}
        if self.at_chance < COLLAPSE_EPOCHS:
            return None
        return {"kind": "collapsed" if self.better else "learned nothing",
                "since_epoch": self.since, "epochs_at_chance": self.at_chance,
                "chance_loss": self.chance_loss, **self.last}

    def line(self) -> str:
        """The one line that says what happened and what to try."""
        last = self.last
        if self.fell_back:
            return (f"training fell back: test accuracy {100 * last['test_accuracy']:.1f}% at "
                    f"epoch {last['epoch']} against {100 * self.best[0]:.1f}% at epoch "
                    f"{self.best[1]}: under half its gain over chance ({100 / self.classes:.1f}%) "
                    f"since epoch {self.fallen_since}; try a lower --lr or --momentum, "
                    "--clip-grad-norm 1 or --warmup-epochs 1")
        what = (f"training collapsed: since epoch {self.since} the training loss has sat at "
                f"chance" if self.better else
                f"training learned nothing: for the last {self.at_chance} epochs the training "
                "loss sat at chance")
        return (f"{what} (ln {self.classes} = {self.chance_loss:.4f}; epoch {last['epoch']}: "
                f"{last['train_loss']:.4f}, accuracy {100 * last['train_accuracy']:.1f}%); try a "
                "lower --lr or --momentum, --clip-grad-norm 1 or --warmup-epochs 1")

    def last_line(self, stopped: bool, reason: str | None, step: int, epochs: int,
                  test_acc: float, wall: float, checkpoint: Path, out: Path) -> str:
        """The run's last line: how it stopped, or what it learned (``done:`` only for a
        completed run that did not collapse)."""
        resume = f"checkpoint in {checkpoint} (continue with --resume)"
        if reason:
            return f"stopped by {reason} at step {step}; {resume}"
        if verdict := self.verdict():
            tested = f": test accuracy {100 * test_acc:.2f}%" if math.isfinite(test_acc) else ""
            return f"{verdict['kind']}{tested} after {epochs} epochs; {self.line()}"
        if stopped:
            return f"stopped at step {step} as asked; {resume}"
        return (f"done: test accuracy {100 * test_acc:.2f}% after {epochs} epochs in "
                f"{wall:.1f} s; results in {out}")
