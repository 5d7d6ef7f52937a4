"""One typed configuration for a training run, validated once before any worker starts.

Values come from, in increasing priority: the defaults below, a ``--config`` YAML/JSON file,
and command-line flags. The resolved configuration is saved as ``config.json`` in the run
directory. Each field is one setting: its ``shoal train`` flag (help, choices, how the text
is read) lives in the field's metadata (see :mod:`shoal.schema`), so a new setting is one
line here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.core.limits import cpu_bound
from shoal.errors import ShoalError
from shoal.schema import (
    MAX_DURATION_S,
    MAX_FLOAT,
    check_bounds,
    check_rules,
    check_value,
    field_kind,
    field_types,
    flag_name,
    float_or_text,
    int_or_text,
    parse_duration,
    parse_floats,
    parse_names,
    parse_shape,
    parse_step_window,
    setting,
    show_value,
)

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "bar", "plain", "none")
#: ``--precision``: float32, or autocast to bfloat16 / float16 (the latter with a GradScaler).
PRECISIONS = ("32", "bf16-mixed", "16-mixed")

#: ``--lr`` unless given: sync's; an asynchronous strategy's under ``--momentum auto`` is
#: scaled from it (:func:`shoal.train.optim.resolve_momentum`).
DEFAULT_LR = 0.05
#: ``--seed`` is at most this (NumPy's range): seeds derived from it (``seed * 1_000_003 +
#: epoch`` for the data order, ``seed + 10_007 * (rank + 1)`` for augmentation) must still fit
#: the 64 bits ``torch.manual_seed`` takes.
MAX_SEED = 2**32 - 1


def _models() -> str:
    from shoal.models import MODELS

    return f"{', '.join(MODELS)}, or pkg.module:factory"


def _datasets() -> str:
    from shoal.data import dataset_names

    return ", ".join(dataset_names())


@dataclass
class TrainConfig:
    """Everything ``shoal train`` needs (``shoal train --help`` lists the flags)."""

    model: str = setting("lenet5", _models, section="what to train")
    dataset: str = setting("digits", _datasets)
    data_dir: str | None = setting(None, "directory holding the dataset's files")
    synthetic_shape: tuple[int, ...] = setting((3, 32, 32), "input shape of --dataset synthetic",
                                               metavar="CxHxW", parse=parse_shape)
    synthetic_classes: int = setting(10, "classes of --dataset synthetic", metavar="N",
                                     at_least=1)
    synthetic_samples: int = setting(2048, "training samples of --dataset synthetic (test: a "
                                     "fifth as many)", metavar="N", at_least=1)
    synthetic_noise: float = setting(1.5, "standard deviation of --dataset synthetic's noise "
                                     "around each class's prototype (more: harder)",
                                     metavar="SIGMA", at_least=0)
    image_size: int | None = setting(None, "resize imagefolder images to PX x PX", metavar="PX",
                                     at_least=1)
    augment: bool = setting(False, "random flips and padded crops (an eighth of the height) of "
                            "training images")
    loader_workers: int | str = setting("auto", "background processes per worker that read "
                                        "(decode) the batches, through torch's DataLoader; "
                                        "auto: 0 for data held in memory, else min(4, cores "
                                        "per worker)", metavar="N|auto",
                                        parse=int_or_text, kind="an integer or auto")

    workers: int | None = setting(None, "local worker processes to spawn (default: one per GPU "
                                  "with --device cuda, else 1); not used under "
                                  "torchrun/Slurm/mpirun", section="where and how", at_least=1)
    threads_per_worker: int | None = setting(None, "intra-op threads per worker (default: "
                                             "cores // workers)", at_least=1, at_most=cpu_bound)
    device: str = setting("auto", "where workers compute; auto: cuda when available",
                          choices=DEVICES)
    strategy: str = setting("sync", "how workers couple; see `shoal list`")
    timeout: float = setting(300.0, "seconds any collective may wait for a peer", metavar="S",
                             positive=True)
    heartbeat_timeout: float = setting(10.0, "seconds a worker may go without a heartbeat "
                                       "before the job stops and names it as hung (stopped, "
                                       "deadlocked)", metavar="S", positive=True)
    max_restarts: int = setting(0, "when a worker fails, restart the job from its last "
                                "checkpoint, up to N times", metavar="N", at_least=0)
    elastic: bool = setting(False, "go on without a worker that dies or stops answering, its "
                            "share of the epoch trained by the others (docs/elastic.md)")
    max_workers: int | None = setting(None, "with --elastic: the most workers once some join "
                                      "(shoal join OUT; default --workers)", at_least=1)
    record_samples: bool = setting(False, "with --elastic: write OUT/samples/worker<i>.jsonl, "
                                   "the samples each worker trained, once they count (a check "
                                   "that none is lost or trained twice)")
    # each strategy's Options: one flag per field, under the strategy options' heading
    strategy_options: dict[str, Any] = setting(factory=dict, section="strategy options",
                                               flag=False)

    epochs: int = setting(10, section="optimization", at_least=1)
    batch_size: int = setting(16, "per worker", at_least=1)
    global_batch_size: int | None = setting(None, "total over workers; overrides --batch-size",
                                            at_least=1)
    accumulate: int = setting(1, "micro-batches of --batch-size per optimizer step (gradient "
                              "accumulation; the global batch grows K times)", metavar="K",
                              at_least=1)
    precision: str = setting("32", "32: float32; bf16-mixed / 16-mixed: autocast the forward "
                             "and loss to bfloat16 / float16 (16-mixed with a gradient scaler); "
                             "parameters stay float32", choices=PRECISIONS)
    clip_grad_norm: float | None = setting(None, "clip the total norm of the gradient applied "
                                           "to X", metavar="X", positive=True)
    compile: bool = setting(False, "torch.compile the model")
    channels_last: bool = setting(False, "channels-last memory format for the model and its "
                                  "image inputs (convolutional models)")
    optimizer: str = setting("sgd", choices=OPTIMIZERS)
    lr: float | None = setting(None, f"peak learning rate (default {DEFAULT_LR}; with SGD and "
                               "--momentum auto, an asynchronous strategy's is scaled to take "
                               "sync's step per sample, or five sixths of it)", positive=True)
    momentum: float | str = setting("auto", "SGD momentum, below 1; auto (the default): T = 0.9 "
                                    "(auto:T for another), less the momentum 1 - 1/g that g "
                                    "groups updating asynchronously add (Omnivore): max(0, T - "
                                    "(1 - 1/g))", metavar="M|auto[:T]",
                                    parse=float_or_text, kind="a number, auto or auto:T")
    #: What ``--momentum auto`` became (target, groups, implicit and explicit momentum), and
    #: the learning rate it scaled (base, factor); set when the run starts
    #: (:func:`shoal.train.optim.resolve_momentum`), kept in config.json.
    momentum_auto: dict[str, float] | None = setting(None, flag=False)
    lr_auto: dict[str, float] | None = setting(None, flag=False)
    nesterov: bool = setting(False, "Nesterov momentum (needs --momentum > 0)")
    weight_decay: float = setting(0.0, at_least=0)
    schedule: str = setting("cosine", "learning rate schedule after the warm-up",
                            choices=SCHEDULES)
    warmup_epochs: float = setting(0.0, "epochs of linear learning rate warm-up", at_least=0)
    lr_milestones: tuple[float, ...] = setting((), "epochs at which --schedule step multiplies "
                                               "the lr by --lr-gamma", metavar="E1,E2",
                                               parse=parse_floats)
    lr_gamma: float = setting(0.1, "the factor of --schedule step, in (0, 1]")
    scale_lr: bool = setting(False, "multiply the lr by the number of workers (linear scaling "
                             "rule)")
    seed: int = setting(0, f"seed of the initial weights and the data order, 0 to {MAX_SEED}")

    target_accuracy: float | None = setting(None, "the test accuracy to reach, in (0, 1]: "
                                            "--strategy auto (and shoal plan) pick the "
                                            "configuration predicted to reach it soonest",
                                            metavar="A", section="planning (--strategy auto, "
                                            "shoal plan; see docs/planning.md)")
    plan_budget: str = setting("auto", "wall time the planner's trials may take (90s, 5m, 1h); "
                               "auto: a tenth of sync's predicted time, timed by a probe of "
                               "sync's first steps (none for a run too short to pay for it)",
                               metavar="TIME")
    plan_probe: int | None = setting(None, "set by --strategy auto: time this sync run's first "
                                     "STEPS steps and stop there (checkpointed) if a tenth of "
                                     "its predicted time pays for planning; else go on",
                                     metavar="STEPS", at_least=4)
    plan_probe_since: float | None = setting(None, "when the run's launch began (a UNIX time; "
                                             "--strategy auto: when it started): the probe's "
                                             "start-up counts from it", metavar="TIME")
    plan_candidates: tuple[str, ...] = setting(("sync", "local-sgd", "easgd", "diloco", "groups"),
                                               "strategies the planner tunes", metavar="S1,S2",
                                               parse=parse_names)
    trial_epochs: float | None = setting(None, "epochs each trial trains, a fraction allowed "
                                         "(0.25: a quarter epoch; default: a tenth of --epochs, at "
                                         "most 100 steps)",
                                         metavar="E", positive=True)
    replan_every: str | None = setting(None, "with --strategy auto: train the winner for about "
                                       "TIME, re-plan from its checkpoint (a budget of at most "
                                       "a tenth of TIME), go on with the new winner", metavar="TIME")

    out: str = setting("runs/latest", "run directory", section="outputs")
    overwrite: bool = setting(False, "start over in an --out that holds a run")
    resume: str | None = setting(None, "continue from CHECKPOINT (default <out>/checkpoint.pt); "
                                 "`auto`: from <out>/checkpoint.pt if it exists, else start "
                                 "over (for jobs a scheduler or torchrun --max-restarts starts "
                                 "again)", nargs="?", const="", metavar="CHECKPOINT")
    init_from: str | None = setting(None, "start from CHECKPOINT's evaluation model (sync's model, "
                                    "EASGD's center, the servers' center) with a fresh optimizer "
                                    "and strategy state, whatever its strategy (warm start)",
                                    metavar="CHECKPOINT")
    init_progress: bool = setting(False, "with --init-from: also go on from its step, epoch and "
                                  "learning-rate schedule position, in its metrics.jsonl (same "
                                  "seed and global batch)")
    checkpoint_every: int = setting(0, "also checkpoint every STEPS steps (default: at each "
                                    "epoch end)", metavar="STEPS", at_least=0)
    stop_at_step: int | None = setting(None, "checkpoint and stop after STEP steps (split a run "
                                       "into jobs)", metavar="STEP", at_least=1)
    allow_collapse: bool = setting(False, "go on when the training loss has sat at chance (ln "
                                   "C for C classes) for 3 epochs after having done better, "
                                   "and exit 0 (the summary still says \"collapsed\")")
    log_every: int = setting(10, "log the training loss every STEPS steps", metavar="STEPS",
                             at_least=1)
    eval_every: int = setting(1, "evaluate every EPOCHS epochs", metavar="EPOCHS", at_least=1)
    eval_every_steps: int | None = setting(None, "also evaluate every STEPS steps (asynchronous: "
                                           "global batches of the workers' samples) and at "
                                           "--stop-at-step (`eval` records)", metavar="STEPS",
                                           at_least=1)
    progress: str = setting("auto", "how to show progress; auto: a bar on a terminal, else plain lines",
                            choices=PROGRESS)

    trace: bool = setting(False, "write OUT/trace.json: every step's spans, one lane per rank "
                          "(Chrome trace format; open in https://ui.perfetto.dev)",
                          section="observability (see docs/observability.md)")
    # FIRST:LAST, read by parse_step_window in validate(), as a config file's value is
    profile: tuple[int, ...] | None = setting(None, "hand steps FIRST to LAST to torch.profiler; "
                                              "writes OUT/profile/rank*.json",
                                              metavar="FIRST:LAST", parse=str)
    tensorboard: bool = setting(False, "also log scalars to OUT/tensorboard (needs the "
                                "tensorboard package)")

    # -- derived --------------------------------------------------------------------------
    def global_batch(self, world: int) -> int:
        """Samples per optimizer step: ``--global-batch-size``, else ``--batch-size`` x
        workers x ``--accumulate``."""
        return self.global_batch_size or self.batch_size * world * self.accumulate

    def base_lr(self, world: int) -> float:
        """The peak learning rate: ``lr`` (:data:`DEFAULT_LR` unless given or resolved), times
        the workers with ``--scale-lr``."""
        lr = self.lr if self.lr is not None else DEFAULT_LR
        return lr * world if self.scale_lr else lr

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.out) / "checkpoint.pt"

    @property
    def resume_path(self) -> Path | None:
        if self.resume is None:
            return None
        return Path(self.resume) if self.resume else self.checkpoint_path

    @property
    def continues_from(self) -> Path | None:
        """The checkpoint whose position and records this run goes on from: ``--resume``'s,
        or ``--init-from``'s with ``--init-progress``."""
        if self.resume_path is not None:
            return self.resume_path
        return Path(self.init_from) if self.init_from and self.init_progress else None

    def momentum_target(self) -> float | None:
        """The target of ``--momentum auto[:T]`` (0.9 without ``:T``); ``None`` for a number."""
        if not isinstance(self.momentum, str):
            return None
        name, colon, target = self.momentum.partition(":")
        try:
            value = float(target) if colon else 0.9
        except ValueError:
            value = math.nan
        if name.strip() != "auto" or not 0 <= value < 1:
            raise ShoalError(f"--momentum must be a number in [0, 1), auto or auto:T with T in "
                             f"[0, 1), got {self.momentum!r}")
        return value

    # -- validation -----------------------------------------------------------------------
    def validate(self) -> TrainConfig:
        """Raise :class:`ShoalError` naming the first bad value; return ``self``. Each field
        is checked against its annotation and normalized, then its metadata's choices and
        range (:func:`~shoal.schema.check_rules`), then the checks across fields, last
        :func:`~shoal.schema.check_bounds` (floats finite within float32, ints int64)."""
        hints = {k: v for k, v in field_types(TrainConfig).items()
                 if k != "profile" or self.profile is None}  # parse_step_window checks it
        for name, hint in hints.items():
            value = check_value(getattr(self, name), hint, flag_name(name), bounds=False,
                                kind=field_kind(TrainConfig, name))
            if name == "strategy_options":
                value = {str(k).replace("-", "_"): v for k, v in value.items()}
            setattr(self, name, value)
        check_rules(self)
        self._check_combinations()
        self._check_planning()
        if self.profile is not None:
            self.profile = parse_step_window(self.profile)
        for name in hints:  # what the checks above leave: floats finite float32, ints int64
            check_bounds(getattr(self, name), flag_name(name))
        if self.scale_lr and self.workers is not None and self.base_lr(self.workers) > MAX_FLOAT:
            raise ShoalError(f"--lr {self.base_lr(1):g} --scale-lr with {self.workers} workers is "
                             f"beyond float32 ({MAX_FLOAT:.3g})")
        return self

    def _check_combinations(self) -> None:
        """The checks that involve more than one field, or a bound of their own (timeouts at
        most a week: far below what ``timedelta`` and Gloo's rendezvous can hold)."""
        if self.global_batch_size is not None and self.workers is not None \
                and self.global_batch_size < self.workers:
            raise ShoalError(f"--global-batch-size {self.global_batch_size} is smaller than "
                             f"--workers {self.workers}")
        for name in ("timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if value > MAX_DURATION_S:
                raise ShoalError(f"{flag_name(name)} must be at most {MAX_DURATION_S:.0f} seconds "
                                 f"(a week), got {value:g}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ShoalError(f"--seed must be from 0 to {MAX_SEED}, got {show_value(self.seed)}")
        if not self.out:
            raise ShoalError("--out must name a directory, got ''")
        from shoal.data.loader import check_workers

        check_workers(self.loader_workers)
        if isinstance(self.momentum, str):
            self.momentum_target()  # auto[:T]: checked there
        elif not 0 <= self.momentum < 1:
            raise ShoalError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ShoalError("--nesterov needs --momentum > 0")
        if not (0 < self.lr_gamma <= 1):
            raise ShoalError(f"--lr-gamma must be in (0, 1], got {self.lr_gamma}")
        if any(m <= 0 for m in self.lr_milestones):
            raise ShoalError(f"--lr-milestones must be positive epochs, got {self.lr_milestones}")
        if len(self.synthetic_shape) == 0 or any(d < 1 for d in self.synthetic_shape):
            raise ShoalError(f"--synthetic-shape must be positive sizes, got {self.synthetic_shape}")
        if self.resume is not None and self.overwrite:
            raise ShoalError("--resume and --overwrite contradict each other")
        if self.init_from == "":
            raise ShoalError("--init-from must name a checkpoint file, got ''")
        if self.init_progress and self.init_from is None:
            raise ShoalError("--init-progress needs --init-from CHECKPOINT")
        if self.init_from is not None and self.resume not in (None, "auto"):
            raise ShoalError("--init-from and --resume contradict each other (--resume goes on "
                             "with this run's own checkpoint)")

    def _check_planning(self) -> None:
        """The planning settings, whatever the strategy: a setting that only planning reads
        is still a mistake to point out before the run, not after it."""
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ShoalError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.plan_budget != "auto":
            parse_duration(self.plan_budget, "--plan-budget")
        if self.plan_probe is not None and self.strategy != "sync":
            raise ShoalError(f"--plan-probe times a sync run; this run has --strategy "
                             f"{self.strategy}")
        if not self.plan_candidates:
            raise ShoalError("--plan-candidates must name at least one strategy, got none")
        if self.replan_every is not None:
            if self.strategy != "auto":
                raise ShoalError(f"--replan-every re-plans a --strategy auto run; this run has "
                                 f"--strategy {self.strategy}")
            parse_duration(self.replan_every, "--replan-every")

    # -- (de)serialization ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str | None = None) -> TrainConfig:
        """A configuration from ``values``; :meth:`validate` checks it. With ``source`` (say
        ``"config file run.yaml"``), the values' types are checked here, errors naming the
        source and the key."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            shown = ", ".join(show_value(u) if not u.isidentifier() else u for u in unknown)
            raise ShoalError(f"{source + ': ' if source else ''}unknown configuration keys: "
                             f"{shown}")
        if type(values.get("precision")) is int:  # YAML reads `precision: 32` as a number
            values = {**values, "precision": str(values["precision"])}
        if source is not None:
            check_values(values, source)
        clean = {}
        for k, v in values.items():
            clean[k] = tuple(v) if isinstance(v, list) and k != "strategy_options" else v
        return cls(**clean)


def check_values(values: dict[str, Any], source: str) -> None:
    """Check the types of configuration ``values`` read from ``source`` (a config file),
    naming the source and the key of the first wrong one."""
    hints = field_types(TrainConfig)
    for key, value in values.items():
        if key == "profile" and value is not None:
            try:
                parse_step_window(value)
            except ShoalError as exc:
                raise ShoalError(f"{source}: profile: {exc}") from None
        elif key in hints:  # the ranges: validate(), whose errors the caller may rename
            check_value(value, hints[key], f"{source}: {key}", bounds=False,
                        kind=field_kind(TrainConfig, key))
