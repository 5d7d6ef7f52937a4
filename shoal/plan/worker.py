"""A rank of a planning session (:mod:`shoal.plan.session`): ``python -m shoal.plan.worker
ADDRESS``, started by the planner's launcher as a job (locally, or under torchrun across the
emulated cluster's hosts).

Each rank joins the planner's :class:`~shoal.core.pool.Listener` at ``ADDRESS`` with the
session's secret (:data:`~shoal.core.trust.SEAL_KEY_VAR` in its environment), loads the
data of the first command (the session's base settings), then trains each trial the planner
sends, on the session's process group and its loaded data, and answers ``{"error": null}``
or the error's line. Every message is sealed (:class:`~shoal.core.pool.SealedLink`): a
command the planner did not send is refused, and the rank leaves with that line. A rank
leaves when the planner closes the session, when the planner is gone (its link closes), or
when no command comes for ``--idle-timeout`` seconds.

This module is not imported by :mod:`shoal.plan`, so that ``-m`` runs it fresh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from typing import Any

from shoal.config import TrainConfig
from shoal.core.failures import first_line
from shoal.core.logs import install as install_logging
from shoal.core.pool import SealedLink, join_pool
from shoal.core.trust import Seal
from shoal.errors import ShoalError

log = logging.getLogger("shoal.plan")

#: A session with no command for this long ends (the planner is stuck).
IDLE_TIMEOUT_S = 600.0
#: How long a rank may take to reach the planner's socket.
JOIN_TIMEOUT_S = 60.0


def serve(address: str, idle_timeout: float = IDLE_TIMEOUT_S) -> None:
    """This rank's part of the planning session whose planner listens at ``address``: join
    it with the session's secret (from this process's environment), load the data of its
    first command, then train each trial it sends until it closes the session."""
    from shoal.core.env import Environment, detect_environment

    env = detect_environment() or Environment()
    link = join_pool(address, env.rank, Seal.from_environment(), JOIN_TIMEOUT_S)
    try:
        _serve(link, env, idle_timeout)
    finally:
        link.close()


def _serve(link: SealedLink, env: Any, idle_timeout: float) -> None:
    """Join the job, then answer the planner's commands on ``link``: each after its work,
    a failure with its line before this rank leaves the job."""
    from shoal.core.connect import init_comm
    from shoal.core.env import default_threads
    from shoal.core.timeline import Timeline
    from shoal.data import load_dataset
    from shoal.train.optim import resolve_momentum
    from shoal.train.trainer import Trainer, data_options

    comm = None
    try:
        settings = _next_command(link, "load", idle_timeout)
        if settings is None:
            return
        base = TrainConfig.from_dict(settings)
        threads = base.threads_per_worker or default_threads(env.local_world_size)
        comm = init_comm(env, base.device, base.timeout, threads, Timeline(),
                         heartbeat_timeout=base.heartbeat_timeout)
        data = load_dataset(base.dataset, data_options(base))
        _answer(link, None)
        while (settings := _next_command(link, "train", idle_timeout)) is not None:
            cfg = resolve_momentum(TrainConfig.from_dict(settings), comm.world_size)
            Trainer(cfg, comm, data).run()
            _answer(link, None)
    except BaseException as exc:
        _answer(link, first_line(exc))
        if comm is not None:
            comm.abort(first_line(exc))
        raise
    comm.close()


def _next_command(link: SealedLink, kind: str, idle_timeout: float) -> dict[str, Any] | None:
    """The settings of the planner's next command (``load`` or ``train``); ``None`` when
    the planner closed the session, or sent nothing for ``idle_timeout`` seconds."""
    if not link.poll(idle_timeout):
        return None
    try:
        command = json.loads(link.recv_bytes())
    except EOFError:
        return None
    if not isinstance(command, dict) or not isinstance(command.get(kind), dict):
        raise ShoalError(f"the planner's command is not '{kind}': refusing to act on it")
    return command[kind]


def _answer(link: SealedLink, error: str | None) -> None:
    """Tell the planner how the command went (``error``: its line, or ``None``); a planner
    that is gone is no reason to fail."""
    with contextlib.suppress(OSError):
        link.send_bytes(json.dumps({"error": error}).encode())


def main(argv: list[str] | None = None) -> int:
    """``python -m shoal.plan.worker ADDRESS [--workers N]``: under torchrun (or another
    launcher) this process is one rank; otherwise it spawns ``N`` local workers (one
    worker: this process). The session's secret comes in ``SHOAL_SESSION_KEY``."""
    from shoal.core.env import detect_environment
    from shoal.core.processes import spawn

    p = argparse.ArgumentParser(prog="python -m shoal.plan.worker")
    p.add_argument("address", help="the planner's socket: a path, or HOST:PORT")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT_S)
    args = p.parse_args(argv)
    install_logging()  # its lines as the command's
    try:
        Seal.from_environment()  # before any worker starts: one line without it
        if detect_environment() is not None or args.workers in (None, 1):
            serve(args.address, args.idle_timeout)
        else:
            spawn(args.workers, serve, (args.address, args.idle_timeout))
    except ShoalError as exc:
        log.error(f"shoal: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
