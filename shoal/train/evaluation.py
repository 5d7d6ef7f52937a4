"""Testing a model: :class:`Evaluator`, the trainer's component that does it, timed.

A trainer's ranks each test a contiguous shard of the test set and sum their results; an
asynchronous job's coordinator (server 0) tests the center on all of it, with the same
component (its Comm has no peers). A detached worker leaves testing to its coordinator
(:class:`~shoal.train.remote.RemoteEvaluator`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.timeline import EVAL, Timeline
from shoal.data import ShardLoader

#: Moves a test batch where the model runs (``x, y -> x, y``).
ToDevice = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Evaluator:
    """Test loss and accuracy of a model: each rank of ``comm`` a shard of the test set read
    by ``loader`` (all of it where ``comm`` has no peers), summed over them. Its time goes
    on ``timeline`` (``EVAL``) and into :attr:`eval_s`."""

    def __init__(self, cfg: TrainConfig, comm: Comm, loader: ShardLoader, to_device: ToDevice,
                 timeline: Timeline) -> None:
        self.comm, self.loader, self.to_device, self.timeline = comm, loader, to_device, timeline
        self.batch = max(256, 2 * cfg.batch_size)
        #: Seconds this invocation spent testing (the records' ``eval_s``).
        self.eval_s = 0.0

    def follow(self, loader: ShardLoader) -> None:
        """Read the test set through ``loader`` from now on (a new plan's)."""
        self.loader = loader

    def test(self, model: nn.Module) -> tuple[float, float]:
        """:meth:`evaluate`, its time booked."""
        started = time.perf_counter()
        with self.timeline.span(EVAL):
            result = self.evaluate(model)
        self.eval_s += time.perf_counter() - started
        return result

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Test loss and accuracy of ``model`` (left in the mode it was in). Elastic: a
        worker lost meanwhile took its shard's results with it, so the test is taken again
        over the workers left (each then a shard of their number)."""
        was_training = model.training
        model.eval()
        try:
            while True:
                group = self._group()
                sums = self._shard_sums(model)
                total_loss, total_correct = self.comm.reduce_values(sums)
                if self._group() == group:
                    break
        finally:
            model.train(was_training)
        rows = self.loader.test_size
        return total_loss / rows, total_correct / rows

    def _group(self) -> int | None:
        """The elastic group's membership epoch (``None`` when not elastic)."""
        membership = self.comm.membership
        return None if membership is None else membership.epoch

    def _shard_sums(self, model: nn.Module) -> list[float]:
        """This rank's loss sum and correct predictions on its shard of the test set."""
        device = self.comm.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.float64, device=device)
        shards, rank = (self.comm.world_size, self.comm.rank) if self.comm.active else (1, 0)
        for x, y in self.loader.test_batches(self.batch, shards, rank):
            x, y = self.to_device(x, y)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").double()
            correct += (out.argmax(1) == y).sum()
        return [loss_sum.item(), correct.item()]
