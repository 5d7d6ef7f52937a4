"""Synthetic classification data of any shape, for benchmarks and tests.

Each class has a random prototype; a sample is its class's prototype plus Gaussian noise of
standard deviation ``synthetic_noise`` (1.5 by default), so models learn it (accuracy means
something) while any shape and size can be asked for; more noise makes it harder (more
epochs to a given accuracy, and a lower ceiling).
"""

from __future__ import annotations

import math

import torch

from shoal.core.limits import check_memory
from shoal.data.base import DataOptions, Dataset, TensorSplit
from shoal.errors import ShoalError


def load(opts: DataOptions) -> Dataset:
    shape, classes, n = tuple(opts.synthetic_shape), opts.synthetic_classes, opts.synthetic_samples
    if not shape or any(d < 1 for d in shape):
        raise ShoalError(f"synthetic shape must be positive integers, got {shape}")
    if classes < 2:
        raise ShoalError(f"synthetic data needs at least 2 classes, got {classes}")
    if n < 2:
        raise ShoalError(f"synthetic data needs at least 2 samples, got {n}")
    n_test = max(1, n // 5)
    # float32 prototypes, and each split three times while it is made (index, noise, sum)
    check_memory(f"--synthetic-samples {n} (and {n_test} test samples) of shape "
                 f"{'x'.join(map(str, shape))} in {classes} classes",
                 4 * math.prod(shape) * (classes + 3 * (n + n_test)))
    gen = torch.Generator().manual_seed(opts.seed + 7919)
    protos = torch.randn((classes, *shape), generator=gen)

    def make(count: int) -> TensorSplit:
        y = torch.randint(0, classes, (count,), generator=gen)
        x = protos[y] + opts.synthetic_noise * torch.randn((count, *shape), generator=gen)
        return TensorSplit(x, y)

    return Dataset("synthetic", make(n), make(n_test), shape, classes)
