"""Optimizers and learning-rate schedules (per step, with linear warm-up)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from shoal.config import TrainConfig


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter],
                    lr: float) -> torch.optim.Optimizer:
    """SGD (momentum, Nesterov, weight decay), Adam or AdamW at learning rate ``lr``."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, weight_decay=cfg.weight_decay)


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
