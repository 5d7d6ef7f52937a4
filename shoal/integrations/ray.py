"""shoal's synchronous-family strategies in a Ray Train ``train_func``.

Ray Train's ``TorchTrainer`` starts one process a worker, sets torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and initialises the process group before ``train_func`` runs.
:func:`strategy` couples the model over that group (``shoal.init`` joins it, it makes none of
its own); the loop is shoal's own; :func:`report` checkpoints every rank's state through
``ray.train.report`` after an epoch, and :func:`resume` puts it back from
``ray.train.get_checkpoint()``, on as many workers or on another number::

    def train_func(config):
        ...
        strategy = shoal_ray.strategy("diloco", model, optimizer, tau=8)
        for epoch in range(shoal_ray.resume(strategy), config["epochs"]):
            for x, y in strategy.batches(data.train, batch_size=16, epoch=epoch):
                strategy.backward(F.cross_entropy(strategy.module(x), y))
                strategy.step()
                strategy.zero_grad()
            shoal_ray.report({"epoch": epoch}, strategy, epochs=epoch + 1)

A checkpoint holds every rank's own part (`shoal.Strategy.checkpoint_own`: its strategy
state and, where replicas drift, its model and inner optimizer), and once, of rank 0, the
shared part (`shoal.Strategy.checkpoint_shared`: the model evaluated, which is DiLoCo's global
model and EASGD's center, and the optimizer) and the part a new rank takes (rank 0's, without
its compression residual: `shoal.Strategy.handover_state`). It is written after an epoch's
batches, where shoal closes every round (``strategy.batches`` calls ``end_epoch`` after the
last one; a loop over a loader of its own calls ``strategy.end_epoch(epoch)`` itself): what
the ranks share (DiLoCo's global model and outer optimizer, EASGD's center, local SGD's
average, sync's model and optimizer) is then the same in every rank's part, and holds every
rank's exchanges so far.

- On as many workers every rank takes its own part back: the run goes on as if never stopped.
- On another number a rank that was there takes its own part; a new rank takes rank 0's (its
  inner state restarts from rank 0's, as a worker joining ``shoal train --elastic`` does); the
  part of a rank no longer there is left: its inner optimizer's state, its residual, and for
  EASGD its own model (the center keeps what its pulls moved). ``strategy.batches(batch_size=
  ...)`` deals rows a worker, so the global batch follows the number (give ``global_batch`` to
  keep it). Ray hands a run another number on a restart with ``ScalingConfig(num_workers=
  (min, max))``, or a run of the same ``RunConfig(name, storage_path)`` and another count.
- Refused, in one line: a strategy that needs parameter servers (run it with ``shoal train``),
  a checkpoint inside an epoch's batches, and resuming one made with another strategy, other
  options or another model.

shoal's store is not there (Ray's process group came first): no heartbeat, no ``--elastic``;
Ray restarts a failed worker group from the last checkpoint (``FailureConfig``), and
``TorchConfig(timeout_s=...)`` bounds the collectives (``shoal.init``'s ``timeout`` does not).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import shoal
from shoal.errors import ShoalError
from shoal.schema import flag_name
from shoal.strategies import Strategy, get_strategy, make_options
from shoal.strategies.topology import Topology
from shoal.train.checkpoint import load_checkpoint, save_checkpoint, to_cpu

try:
    import ray.train
    import ray.train.torch
except ImportError as exc:  # the extra is not installed
    raise ShoalError("shoal.integrations.ray needs Ray Train: pip install 'shoal[ray]'") from exc

#: The file of rank 0's shared part and the checkpoint's header, and of each rank's own.
SHARED = "shoal-shared.pt"
OWN = "shoal-rank{}.pt"


def strategy(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             **options: Any) -> Strategy:
    """Couple ``model`` over the Ray Train workers with the strategy ``name``.

    Call it in ``train_func``, on every worker, with the same initial weights on each
    (``torch.manual_seed`` before building the model). It joins the process group Ray
    initialised, on Ray's device (``use_gpu``), keeping the threads Ray gave the worker.

    Args:
        name: ``"sync"``, ``"local-sgd"``, ``"easgd"``, ``"eamsgd"``, ``"diloco"``, or another
            registered strategy whose workers are all the job's ranks.
        model: This worker's model (not wrapped: ``sync`` wraps it in DDP itself).
        optimizer: The optimizer over ``model``'s parameters.
        **options: The strategy's options, by field name (``tau=8``, ``fragments=2``,
            ``overlap_steps=1``, ``outer_precision="int4"``).

    Returns:
        The `shoal.Strategy`: the loop calls its ``batches``, ``module``, ``backward``,
        ``step`` and ``zero_grad``; ``eval_module`` is the model to evaluate.

    Raises:
        ShoalError: An unknown strategy or option; one that needs parameter servers; a call
            outside a Ray Train worker; a process whose rank is not Ray's.
    """
    cls = get_strategy(name)
    made = make_options(cls, options)
    if cls.topology(made, 2) != Topology(2):
        raise ShoalError(f"strategy {name} needs shoal to lay out its processes (parameter "
                         "servers beside the workers): run it with shoal train or shoal run")
    rank, world = _ray_place()
    device = ray.train.torch.get_device()
    comm = shoal.init(device=device.type, threads=torch.get_num_threads())
    if (comm.rank, comm.world_size) != (rank, world):
        raise ShoalError(f"shoal.init made this process rank {comm.rank} of {comm.world_size}, "
                         f"Ray Train worker {rank} of {world}")
    if comm.device != device:  # GPUs: shoal takes local rank r's GPU r of those visible
        raise ShoalError(f"shoal.init put this worker on {comm.device}, Ray Train on {device}: "
                         "leave Ray's CUDA_VISIBLE_DEVICES shared among a node's workers")
    return shoal.strategy(name, model, optimizer, comm, **options)


def _ray_place() -> tuple[int, int]:
    """This Ray Train worker's rank and the number of workers, or a one-line error."""
    try:
        context = ray.train.get_context()
        return context.get_world_rank(), context.get_world_size()
    except RuntimeError:
        raise ShoalError("shoal.integrations.ray.strategy runs inside a Ray Train train_func "
                         "(TorchTrainer(train_func, ...).fit()); outside it use "
                         "shoal.strategy") from None


def report(metrics: Mapping[str, Any], strategy: Strategy, *, epochs: int) -> None:
    """``ray.train.report(metrics, checkpoint=...)``, the checkpoint holding every rank's state
    after ``epochs`` finished epochs. Call it on every worker, after an epoch's batches.

    Args:
        metrics: What ``ray.train.report`` reports (rank 0's are kept with the checkpoint).
        strategy: The strategy :func:`strategy` made.
        epochs: The epochs finished: where :func:`resume` goes on.

    Raises:
        ShoalError: Called inside an epoch's batches (see :func:`save`).
    """
    with tempfile.TemporaryDirectory(prefix="shoal-ray-") as directory:
        save(strategy, directory, epochs=epochs)
        ray.train.report(dict(metrics), checkpoint=ray.train.Checkpoint.from_directory(directory))


def save(strategy: Strategy, directory: str | Path, *, epochs: int) -> None:
    """Write this rank's part of a checkpoint into ``directory`` (rank 0 also the shared
    part); every rank's files together are the checkpoint :func:`load` reads. What
    :func:`report` does before it hands the directory to Ray.

    Args:
        strategy: The strategy whose state to save.
        directory: Where to write (created if missing).
        epochs: The epochs finished.

    Raises:
        ShoalError: Called inside an epoch's batches, where rounds are still open and the
            ranks' shared state differs (a checkpoint goes after the epoch's last batch).
    """
    if strategy.batch_share is not None:
        raise ShoalError("a shoal checkpoint goes after an epoch's batches (its rounds closed), "
                         "not inside them: report after the `for ... in strategy.batches(...)` "
                         "loop")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ShoalError(f"epochs must be the number of finished epochs, got {epochs!r}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    comm = strategy.comm
    save_checkpoint(path / OWN.format(comm.rank), {"own": to_cpu(strategy.checkpoint_own())})
    if comm.rank == 0:
        handover = {**strategy.checkpoint_own(), "strategy": strategy.handover_state()}
        save_checkpoint(path / SHARED, {
            "integration": "ray", "strategy": strategy.name, "options": _options(strategy),
            "workers": comm.world_size, "epochs": epochs, "steps": strategy.steps,
            "shared": to_cpu(strategy.checkpoint_shared()), "handover": to_cpu(handover)})


def resume(strategy: Strategy, checkpoint: ray.train.Checkpoint | None = None) -> int:
    """Put back the state of ``checkpoint`` (default ``ray.train.get_checkpoint()``: the run's
    last one, after a restart or in a run of the same ``RunConfig(name, storage_path)``), on
    as many workers as made it or another number (the module's docstring says what carries
    over).

    Args:
        strategy: The strategy :func:`strategy` made, before its first step.
        checkpoint: A checkpoint :func:`report` made; default the run's last one.

    Returns:
        The epochs it holds (where the loop goes on); 0 without a checkpoint.

    Raises:
        ShoalError: See :func:`load`.
    """
    checkpoint = checkpoint if checkpoint is not None else ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as directory:
        return load(strategy, directory)


def load(strategy: Strategy, directory: str | Path) -> int:
    """Put back this rank's part of the checkpoint in ``directory`` (:func:`save`'s files).

    Args:
        strategy: The strategy to restore, before its first step.
        directory: The checkpoint's directory.

    Returns:
        The epochs the checkpoint holds.

    Raises:
        ShoalError: No shoal checkpoint there, or one of another strategy, other options or
            another model, or a rank's part missing.
    """
    path, rank = Path(directory), strategy.comm.rank
    if not (path / SHARED).is_file():
        raise ShoalError(f"{path} holds no checkpoint of shoal.integrations.ray.report")
    head = load_checkpoint(path / SHARED)
    check_fits(head, strategy)
    saved = int(head["workers"])
    if rank < saved:
        own_path = path / OWN.format(rank)
        if not own_path.is_file():
            raise ShoalError(f"the checkpoint at {path} has no part of rank {rank} of its "
                             f"{saved}: was it reported by every worker?")
        own = load_checkpoint(own_path)["own"]
    else:
        own = head["handover"]  # a new rank: rank 0's, as a joining worker takes it
    try:
        strategy.restore_checkpoint(head["shared"], own)
    except RuntimeError as exc:  # load_state_dict: shapes or keys that do not fit
        first = (str(exc).strip().splitlines() or [""])[-1].strip()
        raise ShoalError(f"the checkpoint at {path} does not fit this model ({first})") from None
    return int(head["epochs"])


def check_fits(head: Mapping[str, Any], strategy: Strategy) -> None:
    """Raise a one-line error where the checkpoint whose shared part is ``head`` cannot go on
    in ``strategy``: another strategy, or other options."""
    if head.get("integration") != "ray":
        raise ShoalError("not a checkpoint of shoal.integrations.ray.report")
    if head["strategy"] != strategy.name:
        raise ShoalError(f"the checkpoint was made with strategy {head['strategy']}, this run "
                         f"has {strategy.name}")
    mine = _options(strategy)
    for key, value in mine.items():
        if head["options"].get(key) != value:
            flag = flag_name(key)
            raise ShoalError(f"the checkpoint was made with {flag} {head['options'].get(key)}, "
                             f"this run has {flag} {value}")


def _options(strategy: Strategy) -> dict[str, Any]:
    """The strategy's options as plain values (what a checkpoint keeps)."""
    return dataclasses.asdict(strategy.options)
