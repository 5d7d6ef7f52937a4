"""Joining a job from a user's own code (the Fabric-style entry points).

:func:`init` joins the job an outside launcher started (torchrun, Slurm, mpirun) or the one
:func:`launch` starts: ``launch(fn, workers=N)`` runs ``fn`` on N local processes and returns
their results. :func:`strategy` couples a model and optimizer through the joined job.
``shoal run`` is :func:`launch` of :func:`run_main`.
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.core.comm import Comm
from shoal.core.connect import init_comm
from shoal.core.env import Environment, default_threads, detect_environment, rank_environment
from shoal.core.failures import first_line, is_comm_failure
from shoal.core.processes import spawn
from shoal.core.secret import use_secret_file
from shoal.errors import ShoalError
from shoal.strategies import get_strategy, make_options

if TYPE_CHECKING:
    import torch
    from torch import nn

    from shoal.strategies import Strategy

log = logging.getLogger("shoal.runtime")

T = TypeVar("T")

_COMM: Comm | None = None
_THREADS: int | None = None  # set by `shoal run --threads-per-worker` before the script runs
_previous_excepthook: Callable[..., Any] | None = None


def init(device: str = "auto", timeout: float = 300.0, threads: int | None = None, *,
         heartbeat_timeout: float | None = 10.0, secret_file: str | None = None) -> Comm:
    """Join the job this process was launched into.

    Reads torchrun's (Accelerate's, Ray Train's), Lightning's, Slurm's or mpirun's
    environment (or the one `shoal.launch` gives); a process started on its own is a job of
    one, and a launcher's partial environment is an error, never a job of one. Calling it
    again returns the same `Comm`.
    A program need not call `shoal.shutdown`: at exit the job is left in order, and an
    uncaught exception first tells the other ranks, which then stop within seconds.

    Args:
        device: ``"cpu"`` (Gloo), ``"cuda"`` (NCCL, one GPU per rank) or ``"auto"`` (CUDA
            where torch sees a GPU for every rank of this host, else the CPU).
        timeout: Seconds that bound every collective and the rendezvous, so that a lost
            peer is an error, never a hang.
        threads: This process's torch threads; default the machine's cores divided by the
            processes on this node.
        heartbeat_timeout: Seconds a rank may send no heartbeat (stopped, swapped out: not
            merely slow) before the job stops and names it as hung; ``None``: never.
        secret_file: Under torchrun, srun or mpirun, an owner-only file holding the job's
            secret, which seals its store (as ``--secret-file``; default ``SHOAL_SECRET``,
            else one derived: docs/launching.md, security).

    Returns:
        The job's `shoal.core.comm.Comm`: this process's rank, the world size, the device,
            and the collectives a strategy uses.

    Raises:
        ShoalError: An unknown or unavailable ``device``, a ``heartbeat_timeout`` that is not
            a positive number, a launcher's environment that is incomplete, or a job that
            cannot be joined (its store sealed with another secret, its ranks not all there
            within ``timeout``).
    """
    global _COMM
    if _COMM is None:
        if secret_file is not None:
            use_secret_file(secret_file)
        env = rank_environment() or Environment()
        if threads is None:
            threads = _THREADS or default_threads(env.local_world_size)
        _COMM = init_comm(env, device=device, timeout=timeout, threads=threads,
                          heartbeat_timeout=heartbeat_timeout)
        atexit.unregister(_leave_at_exit)  # once, however often init/shutdown alternate
        atexit.register(_leave_at_exit)
        _chain_excepthook()
    return _COMM


def strategy(name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
             comm: Comm | None = None, **options: Any) -> Strategy:
    """Make ``model`` and ``optimizer`` train data-parallel with the strategy ``name``.

    The returned strategy takes the calls a training loop makes anyway (``batches``,
    ``module``, ``backward``, ``step``, ``zero_grad``: `shoal.Strategy`), so one loop runs
    on one process or on many.

    Args:
        name: A registered strategy (``"sync"``, ``"local-sgd"``, ``"easgd"``,
            ``"async-sgd"``, ...: ``shoal.STRATEGIES``) or ``"pkg.module:Class"``.
        model: The model, the same initial weights on every rank.
        optimizer: The optimizer over ``model``'s parameters.
        comm: The job to train in; default the one `shoal.init` joins (torchrun, Slurm,
            mpirun, `shoal.launch`), or a job of one for a process started alone.
        **options: The strategy's options, by field name (``tau=4``, ``alpha=0.5``).

    Returns:
        An instance of the strategy's class, a `shoal.Strategy`.

    Raises:
        ShoalError: An unknown strategy, an option it does not take or a value out of its
            range, or a job that cannot be joined (see `shoal.init`).
    """
    cls = get_strategy(name)
    comm = comm if comm is not None else init()
    return cls(model, optimizer, comm, make_options(cls, options))


def shutdown() -> None:
    """Leave the job joined by `shoal.init`, once every rank has left it too.

    Optional: a program that never calls it leaves the job in order at exit. Calling it
    without a joined job does nothing; a later `shoal.init` joins a new one.

    Raises:
        RuntimeError: Another rank did not leave within `shoal.init`'s ``timeout`` (the
            job's store times out waiting for it: ``torch.distributed.DistStoreError``).
    """
    _leave("called shoal.shutdown()")


def _leave(how: str) -> None:
    """Leave the joined job, if any; ``how`` this rank ended, for the others' report should
    one of them still wait for it in a collective."""
    global _COMM
    if _COMM is not None:
        comm, _COMM = _COMM, None
        comm.close(how)


def _abort(exc: BaseException) -> None:
    """Tell the other ranks of the joined job, if any, that this one failed with ``exc``
    (a lost connection may be the echo of a rank that left first: :meth:`Comm.abort`)."""
    if _COMM is not None:
        _COMM.abort(_describe(exc), echo=is_comm_failure(exc))


def _leave_at_exit() -> None:
    # Without this, a script that never calls shutdown() leaves the process group to the
    # interpreter's teardown, where rank 0 (the store's host) may exit while another rank's
    # watchdog is asking the store, which ends that rank in std::terminate. After an
    # uncaught exception the Comm is aborted, and close() then does not wait for anyone.
    comm = _COMM
    if comm is None:
        return
    try:
        _leave("exited")
    except Exception as exc:
        # The others never came (another rank died, the store is gone). An exception here
        # would be printed and the exit status left at 0, so say it in one line and fail.
        log.error(f"shoal: rank {comm.rank}: could not leave the job cleanly: "
                  f"{type(exc).__name__}: {first_line(exc)}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _chain_excepthook() -> None:
    global _previous_excepthook
    if _previous_excepthook is None:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    # First the other ranks, which may be waiting in a collective for this one; then the
    # usual traceback. The atexit handler that follows finds the Comm aborted.
    _abort(exc)
    assert _previous_excepthook is not None
    _previous_excepthook(kind, exc, tb)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"exited with code {exc.code}"
    if not str(exc).strip():
        return type(exc).__name__
    return f"{type(exc).__name__}: {first_line(exc)}"


def _launched(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T | None:
    """One rank of :func:`launch`: run ``fn``, then leave the job (or tell the others)."""
    import torch

    env = detect_environment() or Environment()
    torch.set_num_threads(_THREADS or default_threads(env.local_world_size))
    # A script's end is its process's (status 0); a function returns.
    how = "exited with status 0" if fn is run_main else "returned"
    try:
        result = fn(*args, **kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _abort(exc)
            raise
        result, how = None, "exited with status 0"
    except BaseException as exc:
        _abort(exc)
        raise
    _leave(how)
    return result


def launch(fn: Callable[..., T], *args: Any, workers: int, **kwargs: Any) -> list[T]:
    """Run ``fn(*args, **kwargs)`` in ``workers`` new local processes joined as one job.

    Each process is one rank: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` are set, so `shoal.init` and `shoal.strategy` inside
    ``fn`` join it (Gloo on CPU, one GPU per rank with NCCL under ``device="cuda"``). ``fn``
    and the arguments are sent by value where they are not importable (functions of a
    script, of stdin, of a notebook), and the main program is not run again in the workers,
    so no ``if __name__ == "__main__":`` guard is needed. Each rank gets cores // workers
    torch threads; ``fn`` need not call `shoal.shutdown`.

    Args:
        fn: The function every rank runs.
        *args: Its positional arguments, the same on every rank.
        workers: How many processes (ranks) to start, at least 1.
        **kwargs: Its keyword arguments, the same on every rank.

    Returns:
        The ranks' return values in rank order (picklable with cloudpickle; ``None`` for a
            rank that ended with ``sys.exit(0)`` or ``os._exit(0)``).

    Raises:
        ShoalError: ``workers`` is not a positive integer, or this process is already a rank
            of a job of several (call ``fn`` directly there).
        WorkerError: A rank raised or exited with a non-zero status (the other ranks are
            stopped within seconds, even those blocked in a collective); it names the rank
            and the first line of its error, with its traceback in ``.traceback``. So does a
            rank that ends (returns, exits with status 0) while another waits for it in a
            collective it never joined (``rank 1: returned while the others were still
            running``), or that does not come to a collective within `shoal.init`'s
            ``timeout``; a rank that merely finishes earlier than the others is normal.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ShoalError(f"shoal.launch needs workers=N with N >= 1, got {workers!r}")
    outer = detect_environment()
    if outer is not None and outer.world_size > 1:
        raise ShoalError(f"shoal.launch starts a job of its own, but this process is already rank "
                         f"{outer.rank} of {outer.world_size} ({outer.launcher}); call the "
                         "function directly")
    return spawn(workers, _launched, (fn, args, kwargs))


def run_main(target: str, argv: list[str], module: bool = False,
             threads: int | None = None) -> None:
    """Run the script ``target`` (or the module, with ``module=True``) as ``__main__``, as
    ``python SCRIPT ARGS...`` / ``python -m MODULE ARGS...`` would: ``sys.argv`` is
    ``[target, *argv]`` and the script's directory (for a module, the current directory)
    comes first on ``sys.path``. ``threads``: the default of :func:`init` in this process.
    """
    global _THREADS
    if threads is not None:
        import torch

        _THREADS = threads
        torch.set_num_threads(threads)
    sys.argv = [target, *argv]
    if module:
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
