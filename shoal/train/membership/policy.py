"""What ``--elastic`` takes: the strategies and options a job that goes on without a lost
worker (and takes joiners) can run, checked before any worker starts. Every launcher takes
it: shoal's own, and torchrun, Slurm and mpirun through a keeper per rank
(:mod:`shoal.core.keeper`)."""

from __future__ import annotations

from shoal.config import TrainConfig
from shoal.errors import ShoalError

#: The strategies that take ``--elastic``: the synchronous and periodic ones (a re-formed
#: group) and the asynchronous ones, whose server 0 deals a lost worker's rest
#: (:mod:`shoal.train.membership.tracker.detached`; hogwild's server 0 is its coordinator; a compute
#: group of ``groups`` is dealt to as one, and re-forms when it loses a member).
ASYNC_ELASTIC = ("async-sgd", "async-msgd", "async-easgd", "async-measgd", "hogwild-easgd",
                 "hogwild", "groups")
ELASTIC = ("sync", "local-sgd", "easgd", "eamsgd", "diloco", *ASYNC_ELASTIC)


def check_elastic(cfg: TrainConfig) -> None:
    """One line where ``--elastic`` cannot work (before any worker starts)."""
    if not cfg.elastic:
        for flag, value in (("--record-samples", cfg.record_samples),
                            ("--max-workers", cfg.max_workers is not None)):
            if value:
                raise ShoalError(f"{flag} is for --elastic jobs; add --elastic")
        return
    if cfg.max_workers is not None and cfg.workers is not None and cfg.max_workers < cfg.workers:
        raise ShoalError(f"--max-workers {cfg.max_workers} is less than --workers {cfg.workers}")
    if cfg.strategy not in ELASTIC:
        raise ShoalError(f"--elastic works with {', '.join(ELASTIC)} (not yet with "
                         f"{cfg.strategy})")
    if cfg.strategy == "groups" and cfg.max_restarts:
        raise ShoalError("--elastic groups does not restart yet (--max-restarts): a restart "
                         "goes on from a checkpoint of compute groups that lost a worker; "
                         "leave it out, or use async-msgd")
    if cfg.strategy in ASYNC_ELASTIC:
        return
    if cfg.strategy_options.get("host_sync"):
        raise ShoalError("--host-sync keeps each host's processes one replica through its "
                         "memory, which a re-formed group does not follow: leave out --elastic")
