"""Optimizers and learning-rate schedules (per step, with linear warm-up)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from shoal.config import DEFAULT_LR, TrainConfig
from shoal.core.dynamo import eager
from shoal.strategies import get_strategy, make_options

#: The share of sync's step per sample that each stale update takes under ``--momentum
#: auto`` where a velocity is applied to it (async-msgd's server, groups, hogwild's workers on
#: the shared parameters): the whole step diverged or collapsed in some runs, five sixths in
#: none and trains faster than two thirds (docs/asynchronous-defaults.md "Defaults that train");
#: groups of several workers too, whose whole step was the least stable of the defaults
#: (docs/asynchronous-defaults.md "Groups of several workers"). async-sgd takes async-msgd's rate
#: without its velocity.
ASYNC_STEP_SHARE = 5 / 6


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter],
                    lr: float) -> torch.optim.Optimizer:
    """SGD (momentum, Nesterov, weight decay), Adam or AdamW at learning rate ``lr``."""
    if cfg.optimizer == "sgd":
        return eager(torch.optim.SGD)(params, lr=lr, momentum=cfg.momentum,
                                      nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return eager(cls)(params, lr=lr, weight_decay=cfg.weight_decay)


def resolve_momentum(cfg: TrainConfig, workers: int) -> TrainConfig:
    """``cfg`` with ``--momentum auto[:T]`` made a number for this run's strategy on
    ``workers`` workers, and ``--lr`` with it (unless given); ``momentum_auto`` and
    ``lr_auto`` say how.

    Omnivore (Hadjis et al. 2016, after Mitliagkas et al. 2016, "Asynchrony begets
    momentum"): ``g`` groups that update the model asynchronously act as an implicit momentum
    of about ``1 - 1/g``, so the explicit momentum is ``max(0, T - (1 - 1/g))`` for a target
    total ``T`` (0 for a strategy that applies none: async-sgd). ``g`` is the strategy's
    :meth:`~shoal.strategies.Strategy.asynchronous_groups`: 1 for every synchronous strategy
    and the elastic ones (auto is then ``T``, the lr as given), the workers for async-sgd,
    async-msgd and hogwild, ``--groups`` for groups.

    The learning rate takes :data:`ASYNC_STEP_SHARE` of sync's step per sample (the whole
    step where the rule leaves no explicit momentum): sync steps ``lr / (1 - T)`` per global
    batch; here ``g`` updates share that batch, so each steps ``lr' / (1 - explicit)`` with
    ``lr' = share x lr (1 - explicit) / (g (1 - T))`` (at 2 workers: async-msgd and hogwild
    2.5 x lr; groups of two on 4 workers 2.5 x lr too). With a delay of one update a step
    ``eta / (1 - mu)`` is stable only below ``1 / lambda``, whatever ``mu``: momentum buys
    a stale update no stability. async-sgd, which applies no momentum,
    takes async-msgd's ``lr'`` (``explicit`` as the rule gives it, none applied), a step per
    sample ``1 - explicit`` of async-msgd's: a stale plain-SGD update at sync's whole step (5 x lr)
    is past the edge of stability (a delay halves the largest stable rate, Giladi et al.
    2020) and collapsed on noisier data. The momentum alone, at sync's lr, trains 2 to 9
    points below sync in 10 epochs; see docs/asynchronous-defaults.md. Only with SGD (Adam's step
    does not grow with momentum) and an lr not given.
    """
    given = cfg.lr if cfg.lr is not None else DEFAULT_LR
    target = cfg.momentum_target()
    if target is None:
        return dataclasses.replace(cfg, lr=given)
    cls = get_strategy(cfg.strategy)
    groups = cls.asynchronous_groups(make_options(cls, cfg.strategy_options, workers), workers)
    implicit = 1.0 - 1.0 / groups
    ruled = round(max(0.0, target - implicit), 12)  # 0.45, not 0.44999999999999996
    explicit = ruled if cls.applies_momentum else 0.0
    lr, lr_auto = given, None
    if cfg.lr is None and cfg.optimizer == "sgd" and groups > 1:
        share = ASYNC_STEP_SHARE if ruled > 0 else 1.0
        factor = round(share * (1.0 - ruled) / (groups * (1.0 - target)), 12)
        lr, lr_auto = round(given * factor, 12), {"base": given, "factor": factor,
                                                  "share": round(share, 12), "momentum": ruled}
    return dataclasses.replace(cfg, momentum=explicit, lr=lr, lr_auto=lr_auto, momentum_auto={
        "target": target, "groups": groups, "implicit": implicit, "explicit": explicit})


def describe_momentum(cfg: TrainConfig) -> str:
    """``momentum 0.4 (auto: ...), lr 0.15 (auto: ...)``: the run's momentum and learning rate
    as resolved (:func:`resolve_momentum`), and where auto made them, how."""
    momentum, lr = f"momentum {cfg.momentum:g}", f"lr {cfg.base_lr(1):g}"
    auto = cfg.momentum_auto
    if auto and auto["groups"] > 1:
        if get_strategy(cfg.strategy).applies_momentum:
            momentum += (f" (auto: {auto['target']:g} less {auto['implicit']:g} implicit in "
                         f"{auto['groups']:g} asynchronous groups)")
        else:
            momentum += f" (auto: {cfg.strategy} applies none)"
    if cfg.lr_auto:
        share = "sync's" if cfg.lr_auto.get("share", 1.0) == 1.0 else "five sixths of sync's"
        ruled = cfg.lr_auto.get("momentum", cfg.momentum)
        unapplied = f" at momentum {ruled:g}, with none applied" if ruled != cfg.momentum else ""
        lr += (f" (auto: {cfg.lr_auto['base']:g} x {cfg.lr_auto['factor']:g}, {share} step per "
               f"sample{unapplied})")
    return f"{momentum}, {lr}"


def lr_factor(step: int, total: int, warmup: int, schedule: str,
              milestones: list[int], gamma: float) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based) of ``total`` steps."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        span = max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, span) / span))
    if schedule == "step":
        return gamma ** sum(step >= m for m in milestones)
    return 1.0


def build_schedule(cfg: TrainConfig, optimizer: torch.optim.Optimizer,
                   steps_per_epoch: int) -> LambdaLR:
    """Warm-up for ``cfg.warmup_epochs``, then constant, step (milestones in epochs) or cosine."""
    total = cfg.epochs * steps_per_epoch
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    milestones = [round(m * steps_per_epoch) for m in cfg.lr_milestones]
    return LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup, cfg.schedule,
                                                   milestones, cfg.lr_gamma))


def schedule_at(scheduler: LambdaLR, step: int) -> None:
    """Put ``scheduler`` (and its optimizer's rates) where it is after ``step`` steps, from
    its own peak rates: a run that goes on from another's position with other settings."""
    rates = [base * factor(step) for base, factor in zip(scheduler.base_lrs,
                                                          scheduler.lr_lambdas, strict=True)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": step, "_last_lr": rates})
