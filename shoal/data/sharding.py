"""Which samples each rank reads, step by step.

Every epoch all ranks draw the same seeded permutation of the training set and walk it in
global batches of ``batch x workers`` samples; rank ``r`` reads its contiguous slice of each
global batch. Nothing is dropped or repeated: when the set is not a multiple of the global
batch, the tail forms one last, smaller global batch split as evenly as possible (slices
differ by at most one sample). A tail too small to give every rank a sample (fewer samples
than workers) is folded into the batch before it instead.
"""

from __future__ import annotations

import torch

from shoal.errors import ShoalError


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` contiguous shares that differ by at most one."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """The ``[start, end)`` of share ``index`` out of :func:`split_sizes` ``(total, parts)``."""
    sizes = split_sizes(total, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def batch_bounds(n: int, global_batch: int, world: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every global batch in one epoch over ``n`` samples."""
    if n < world:
        raise ShoalError(f"the training set has {n} samples, fewer than the {world} workers")
    if global_batch < world:
        raise ShoalError(f"global batch {global_batch} is smaller than the {world} workers")
    bounds = [(s, min(s + global_batch, n)) for s in range(0, n, global_batch)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < world:
        tail_end = bounds.pop()[1]
        bounds[-1] = (bounds[-1][0], tail_end)
    return bounds


class EpochPlan:
    """The order in which one epoch's samples are read, by step and rank.

    ``order``: the samples to read, instead of the epoch's seeded permutation of all ``n``:
    what is left of an epoch after a worker was lost (:meth:`remaining`)."""

    def __init__(self, n: int, global_batch: int, world: int, seed: int,
                 order: torch.Tensor | None = None) -> None:
        self.n, self.global_batch, self.world, self.seed = n, global_batch, world, seed
        self.order = order
        self.bounds = [] if n == 0 and order is not None else batch_bounds(n, global_batch, world)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.bounds)

    def permutation(self, epoch: int) -> torch.Tensor:
        if self.order is not None:
            return self.order
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=gen)

    def local(self, perm: torch.Tensor, step: int, rank: int) -> tuple[torch.Tensor, int]:
        """Rank ``rank``'s sample indices at ``step`` of the epoch, and the global batch size."""
        start, end = self.bounds[step]
        lo, hi = shard_range(end - start, self.world, rank)
        return perm[start + lo : start + hi], end - start

    def lost_shards(self, perm: torch.Tensor, steps: range, ranks: list[int]) -> list[torch.Tensor]:
        """The samples that ranks ``ranks`` read at ``steps``, step by step, in rank order."""
        return [self.local(perm, step, rank)[0] for step in steps for rank in sorted(ranks)]

    def rest(self, perm: torch.Tensor, done: int) -> torch.Tensor:
        """The samples of the steps after the first ``done``."""
        return perm[self.bounds[done][0]:] if done < len(self.bounds) else perm[:0]
