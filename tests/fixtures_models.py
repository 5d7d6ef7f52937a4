"""User models for the tests, loaded the way users load theirs: --model tests.fixtures_models:NAME."""

import os

import torch
from torch import nn


def tiny(input_shape, num_classes):
    """A user's own model: flatten + linear."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


class _FailOnRank(nn.Module):
    """Behaves like `tiny` until step 3 on rank 1, then fails the way `how` says."""

    def __init__(self, input_shape, num_classes, how):
        super().__init__()
        self.net = tiny(input_shape, num_classes)
        self.calls = 0
        self.how = how

    def forward(self, x):
        if self.training:
            self.calls += 1
            if os.environ.get("RANK") == "1" and self.calls == 3:
                if self.how == "raise":
                    raise RuntimeError("injected failure in the model")
                os.kill(os.getpid(), 9)
        return self.net(x)


def raises_on_rank1(input_shape, num_classes):
    return _FailOnRank(input_shape, num_classes, "raise")


def killed_on_rank1(input_shape, num_classes):
    return _FailOnRank(input_shape, num_classes, "kill")


def wrong_output(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 3))
