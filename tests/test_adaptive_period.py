"""--tau auto: AdaComm's communication period (Wang & Joshi 2019), in one process.

The reference replays the paper's rule on the same losses, in its own variables:
tau_{l} = ceil(tau_0 sqrt(eta_0 F_l / (eta_l F_0))) clipped to [1, tau_0], where F is the
mean training loss of a round; shoal reads a round's loss one round late (its sum travels
behind the next round's compute), so round l + 2 follows F_l.
"""

import math

import pytest
import torch

import shoal
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.errors import ShoalError
from shoal.strategies.period import first_period

TAU0 = 8


def losses(step: int) -> float:
    """A training loss that falls, then rises (so the period shortens, then grows back)."""
    return 2.0 * math.exp(-step / 25) + (0.5 if step > 120 else 0.0)


def lr(step: int) -> float:
    return 0.1 if step < 100 else 0.05  # a decay: AdaComm lengthens the period by sqrt(2)


def reference_rounds(total: int) -> list[int]:
    """The steps after which the workers exchange, by the paper's rule."""
    ends, means, rates = [], [], []
    step, tau = 0, TAU0
    while step + tau <= total:
        round_losses = [losses(s) for s in range(step, step + tau)]
        step += tau
        ends.append(step)
        means.append(sum(round_losses) / tau)
        rates.append(lr(step - 1))
        if len(means) >= 2:  # the round before last is known now
            f, eta = means[-2], rates[-2]
            f0, eta0 = means[0], rates[0]
            tau = min(TAU0, max(1, math.ceil(TAU0 * math.sqrt(eta0 * f / (eta * f0)))))
    return ends


def test_period_follows_adacomm():
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = shoal.strategy("local-sgd", model, opt, comm=Comm(Environment(), torch.device("cpu")),
                              tau="auto:8")
    exchanged = []
    strategy.exchange = lambda: exchanged.append(strategy.steps)
    total = 200
    for step in range(total):
        for group in opt.param_groups:
            group["lr"] = lr(step)
        loss = model.weight.sum() * 0 + losses(step)  # the loss the round's mean is taken of
        strategy.backward(loss)
        strategy.step()
        strategy.zero_grad()
    expected = reference_rounds(total)
    assert exchanged == expected[:len(exchanged)] and len(expected) - len(exchanged) <= 1
    periods = [b - a for a, b in zip([0, *exchanged], exchanged, strict=False)]
    assert min(periods) < TAU0 / 2 and periods[-1] > min(periods)  # it shortened, then grew


def test_period_text():
    assert first_period(4) == 4 and first_period("auto") == 16 and first_period("auto:32") == 32
    for bad in ("sometimes", "auto:0", "auto:x", 0):
        with pytest.raises(ShoalError, match="--tau"):
            first_period(bad)
