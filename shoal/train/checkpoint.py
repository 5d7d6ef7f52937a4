"""Checkpoints that are never half-written and never loaded blindly.

A checkpoint is written with :func:`~shoal.core.files.atomic_write`, so a crash at any
moment leaves either the old or the new file. It is read with
``torch.load(weights_only=True)``: tensors, numbers, strings and containers only, never
arbitrary pickled objects.

What goes in: the run's configuration and progress, what the strategy shares between ranks
(:meth:`~shoal.strategies.Strategy.checkpoint_shared`: the model and optimizer by default)
once, the schedule, under ``"ranks"`` each rank's own state (its RNGs, time and byte
totals, epoch sums and :meth:`~shoal.strategies.Strategy.checkpoint_own`), and under
``"eval_model"`` the model the run evaluates (sync's model, EASGD's center, the servers'
center): what ``--init-from`` starts another run from, whatever its strategy.
"""

from __future__ import annotations

import pickle
import re
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from shoal.config import TrainConfig
from shoal.core.files import atomic_write
from shoal.errors import ShoalError
from shoal.schema import flag_name
from shoal.strategies import Strategy, make_options
from shoal.train.membership.resume import check as check_dealt

FORMAT = "shoal-checkpoint"
VERSION = 1
#: The keys :func:`save_checkpoint` adds to every checkpoint.
CHECKPOINT_HEADER = ("format", "version")

#: The key of the evaluation model, in every checkpoint.
EVAL_MODEL = "eval_model"
#: Configuration keys that must match between a checkpoint and a run starting from its
#: evaluation model (``--init-from``); with ``--init-progress`` also :data:`PROGRESS_KEYS`.
INIT_KEYS = ("model", "dataset")
PROGRESS_KEYS = ("seed",)

#: Configuration keys that must match between a checkpoint and the run resuming it.
RESUME_KEYS = ("model", "dataset", "strategy", "seed", "optimizer", "lr", "momentum",
               "nesterov", "weight_decay", "scale_lr", "schedule", "warmup_epochs",
               "lr_milestones", "lr_gamma", "augment")


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` with every tensor moved to the CPU (for gathering and saving)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as a checkpoint at ``path`` (see :func:`atomic_write`): a full disk
    is one line, ``no space left on device writing PATH; the previous checkpoint is kept``."""
    payload = {"format": FORMAT, "version": VERSION, **payload}
    atomic_write(path, lambda f: torch.save(payload, f), what="checkpoint")


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`, or raise a one-line error.

    ``mmap``: map the tensors' storage instead of reading it, for a caller that only looks
    at the small entries (the progress, the configuration).
    """
    if not path.is_file():
        raise ShoalError(f"no checkpoint at {path}")
    try:
        with warnings.catch_warnings():  # its notes on a refused file's pickle protocol
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise ShoalError(_refused(path, str(exc))) from None
    except Exception as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ShoalError(f"{path} is not a readable checkpoint ({first})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ShoalError(f"{path} is not a shoal checkpoint")
    if payload.get("version") != VERSION:
        raise ShoalError(f"{path} has checkpoint version {payload.get('version')}, "
                         f"this shoal reads version {VERSION}")
    return payload


def _refused(path: Path, message: str) -> str:
    """Why ``torch.load(weights_only=True)`` refused ``path``, in shoal's words: its
    unpickler meets an object it does not allow (a file that would import and run code) or
    no pickle at all. PyTorch's own message advises ``weights_only=False``, which would run
    that code: shoal never does, and does not repeat the advice."""
    named = re.search(r"GLOBAL ([\w.]+)", message)
    if named:
        return (f"{path} is not a checkpoint shoal can load safely: it asks to import "
                f"{named.group(1).rstrip('.')}, and shoal loads only tensors and plain data")
    return f"{path} is not a readable checkpoint (not a file of tensors and plain data)"


class Saved(NamedTuple):
    """What a restart needs of the checkpoint it starts from."""

    step: int  # the step it was written after
    ranks: int  # how many workers' parts it holds
    inside_epoch: bool  # written inside an epoch (not at its end)
    changes: int = 0  # the membership changes it lists (a resumed run's list goes on from them)


def saved_checkpoint(path: Path) -> Saved | None:
    """The step, workers and place of the checkpoint at ``path``; ``None`` if unreadable.

    Its tensors are mapped, not read (``mmap``): a restart asks this of a checkpoint that may
    hold every rank's model and optimizer.
    """
    try:
        payload = load_checkpoint(path, mmap=True)
        progress = payload["progress"]
        return Saved(int(progress["step"]), len(payload["ranks"]), bool(progress["epoch_step"]),
                     len(_changes(payload)))
    except ShoalError:
        return None


def _changes(payload: dict[str, Any]) -> list[Any]:
    """The membership changes a checkpoint lists: a synchronous job's own, or an
    asynchronous one's server 0's (its dealer's)."""
    elastic = (payload.get("coordinator") or {}).get("elastic") or {}
    return list(payload.get("membership_changes") or elastic.get("changes") or [])


def check_resume(payload: dict[str, Any], cfg: TrainConfig, world: int,
                 strategy_cls: type[Strategy]) -> None:
    """Raise a one-line error if ``payload`` cannot continue under ``cfg`` on ``world`` ranks."""
    check_workers(payload, cfg, world, strategy_cls)  # first: --momentum auto's lr follows it
    saved, now = payload["config"], cfg.to_dict()
    for key in RESUME_KEYS:
        if saved.get(key) != now[key]:
            flag = flag_name(key)
            raise ShoalError(f"checkpoint was made with {flag} {saved.get(key)!r}, "
                             f"this run has {flag} {now[key]!r}" + _auto_changed(saved, now, key))
    step = payload["progress"]["step"]
    if cfg.stop_at_step is not None and cfg.stop_at_step <= step:
        raise ShoalError(f"--stop-at-step {cfg.stop_at_step} is not after the checkpoint's step "
                         f"{step}; nothing would be trained")
    # On another number of workers (check_workers) the rest of the epoch is dealt over them
    # (shoal.train.membership.resume); on as many the data order is the checkpoint's.
    saved_world = payload.get("world_size", len(payload["ranks"]))
    if payload["global_batch"] != cfg.global_batch(world) and (
            saved_world == world or "coordinator" in payload):
        raise ShoalError(f"checkpoint was made with a global batch of {payload['global_batch']}, "
                         f"this run has {cfg.global_batch(world)}")
    saved_opts = asdict(make_options(strategy_cls, saved.get("strategy_options") or {}))
    for key, value in asdict(make_options(strategy_cls, cfg.strategy_options)).items():
        if saved_opts.get(key) != value:
            flag = flag_name(key)
            raise ShoalError(f"checkpoint was made with {flag} {saved_opts.get(key)}, "
                             f"this run has {flag} {value}")
    if "coordinator" in payload:  # an asynchronous run's: its shares dealt or not
        check_dealt(payload, cfg.elastic)


def _auto_changed(saved: dict[str, Any], now: dict[str, Any], key: str) -> str:
    """Where the learning rate or momentum that differs was made by ``--momentum auto`` both
    then and now (its rule changed between shoal versions), how to go on as the checkpoint
    was made; else nothing."""
    auto = {"lr": "lr_auto", "momentum": "momentum_auto"}.get(key)
    if auto is None or not (saved.get(auto) and now.get(auto)):
        return ""
    return (f" (--momentum auto's rule has changed since: give --lr {saved.get('lr')} "
            f"--momentum {saved.get('momentum')} to go on as the checkpoint was made)")


def check_workers(payload: dict[str, Any], cfg: TrainConfig, world: int,
                  strategy_cls: type[Strategy]) -> None:
    """Raise a one-line error if ``payload``'s workers cannot go on as ``world``: replicas in
    sync go on on any number; workers that drift apart between meetings on another number
    only from an epoch's end, where every worker's work met (a worker with no state of its
    own takes worker 0's, as a joiner does; one not started leaves its work in the others');
    an asynchronous job's on its own number."""
    saved, progress = len(payload["ranks"]), payload["progress"]
    if strategy_cls.replicas_in_sync or saved == world:
        return
    if "coordinator" in payload:
        more = "; more join with shoal join once it runs" * (cfg.elastic and world > saved)
        raise ShoalError(f"checkpoint holds {saved} workers' state; strategy {cfg.strategy} "
                         f"resumes on as many (--workers {saved}), not {world}{more}")
    if progress["epoch_step"]:
        raise ShoalError(f"checkpoint holds {saved} workers' state at step {progress['step']}, "
                         f"inside epoch {progress['epoch'] + 1}: strategy {cfg.strategy} "
                         f"resumes there on as many, not {world} (on another number only "
                         "from a checkpoint at an epoch's end)")


def check_init(payload: dict[str, Any], cfg: TrainConfig, world: int) -> None:
    """Raise a one-line error if ``cfg`` cannot start from ``payload``'s evaluation model
    (``--init-from``) and, with ``--init-progress``, go on from its position."""
    saved, now = payload["config"], cfg.to_dict()
    for key in INIT_KEYS + (PROGRESS_KEYS if cfg.init_progress else ()):
        if saved.get(key) != now[key]:
            flag = flag_name(key)
            raise ShoalError(f"--init-from {cfg.init_from} was made with {flag} "
                             f"{saved.get(key)!r}, this run has {flag} {now[key]!r}")
    if not cfg.init_progress:
        return
    if payload["global_batch"] != cfg.global_batch(world):
        raise ShoalError(f"--init-from {cfg.init_from} was made with a global batch of "
                         f"{payload['global_batch']}, this run has {cfg.global_batch(world)} "
                         "(--init-progress goes on with the same data order)")
    step, epoch = payload["progress"]["step"], payload["progress"]["epoch"]
    if epoch >= cfg.epochs or (cfg.stop_at_step is not None and cfg.stop_at_step <= step):
        raise ShoalError(f"--init-from {cfg.init_from} is at step {step} (epoch {epoch}): "
                         f"nothing left to train with --epochs {cfg.epochs}"
                         + (f" --stop-at-step {cfg.stop_at_step}" if cfg.stop_at_step else ""))


def eval_model(payload: dict[str, Any]) -> dict[str, Any]:
    """The evaluation model's state dict in ``payload`` (checkpoints from before it had its
    own key: ``"model"``, which held it)."""
    return payload[EVAL_MODEL] if EVAL_MODEL in payload else payload["model"]


def load_eval_model(model: nn.Module, payload: dict[str, Any], source: str | Path) -> None:
    """Put ``payload``'s evaluation model into ``model``, or a one-line error."""
    try:
        model.load_state_dict(eval_model(payload))
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[-1].strip()
        raise ShoalError(f"the evaluation model of {source} does not fit this run's model "
                         f"({first})") from None


def resumes_in_place(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` goes on with the run in its own ``--out`` (``--resume``, or
    ``--init-from --init-progress`` of its own checkpoint), not a checkpoint from elsewhere."""
    source = cfg.continues_from
    return source is not None and source.resolve() == cfg.checkpoint_path.resolve()
