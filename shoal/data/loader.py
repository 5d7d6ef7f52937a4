"""This rank's batches, read in the training process or by background processes.

:class:`ShardLoader` walks the epoch's :class:`~shoal.data.sharding.EpochPlan` from any step
and hands out this rank's batches, and the rank's contiguous shard of the test set. With
``workers`` > 0 the batches are read by ``torch.utils.data.DataLoader`` worker processes
(persistent across epochs, ``PREFETCH`` batches ahead per worker, pinned memory for CUDA):
shoal's plan is the DataLoader's sampler, each item it hands out one whole batch's rows, read
by the split's ``get_batch`` in one worker. So every worker count reads the same rows in the
same order, and a resumed run starts the sampler at the saved step.

A dataset's own transforms (a user's torchvision pipeline) may draw random numbers; the
batches of a split that says so (``draws_random``) are read with Python's, NumPy's and
torch's generators seeded from (seed, epoch, step, rank), the caller's generators left as
they were: the same augmentation with any number of loader workers, and after a resume.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from shoal.core.guard import die_with_parent, name_process
from shoal.data.base import Dataset, Split
from shoal.data.sharding import EpochPlan, shard_range
from shoal.errors import ShoalError

#: ``--loader-workers auto`` starts at most this many per training worker.
AUTO_MAX = 4
#: At most this many per training worker (more is a typo, not a need).
MAX_WORKERS = 128
#: Batches each loader worker reads ahead.
PREFETCH = 2

Batch = tuple[torch.Tensor, torch.Tensor]


def check_workers(value: int | str, flag: str = "--loader-workers") -> None:
    """A one-line error unless ``value`` is ``auto`` or 0..:data:`MAX_WORKERS`."""
    if value == "auto":
        return
    if isinstance(value, str) or not 0 <= value <= MAX_WORKERS:
        shown = repr(value) if isinstance(value, str) else value
        raise ShoalError(f"{flag} must be a number of processes from 0 to {MAX_WORKERS}, or "
                         f"auto, got {shown}")


def resolve_workers(setting: int | str, split: Split) -> int:
    """The loader processes per training worker: ``setting``, or for ``auto`` none for a
    split held in memory (indexing it costs less than a message from another process), else
    min(:data:`AUTO_MAX`, this worker's intra-op threads, that is its share of the cores)."""
    return loader_processes(setting, split, torch.get_num_threads())


def loader_processes(setting: int | str, split: Split, threads: int) -> int:
    """:func:`resolve_workers` for a training worker of ``threads`` intra-op threads."""
    if setting != "auto":
        return int(setting)
    return 0 if getattr(split, "in_memory", False) else min(AUTO_MAX, threads)


def batch_seed(*parts: int | str) -> int:
    """A 63-bit seed mixed from ``parts`` (any ints and words), the same on every machine."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's CPU generators seeded with ``seed`` inside, put back
    after (CUDA's are not touched: data is read on the CPU)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    cpu_state = torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)


class _Rows(torch.utils.data.Dataset):
    """Both splits, read a batch at a time: ``rows[(split, indices, seed)] -> (x, y)``."""

    def __init__(self, splits: dict[str, Split]) -> None:
        self.splits = splits

    def __getitem__(self, key: tuple[str, list[int], int]) -> Batch:
        name, rows, seed = key
        split = self.splits[name]
        idx = torch.tensor(rows, dtype=torch.long)
        if not getattr(split, "draws_random", False):
            return split.get_batch(idx)
        with seeded(seed):
            return split.get_batch(idx)


class _Keys(Sampler):
    """The DataLoader's sampler: the batches of the pass about to start (set before each)."""

    def __init__(self) -> None:
        self.keys: Iterable[Any] = ()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys)


def _start_method() -> str | None:
    """``fork`` where there is one: the loader processes share the training process's
    dataset as it is, nothing pickled or imported again (a dataset from a file.py factory
    could not be unpickled by name). shoal's training processes are themselves spawned,
    which would make ``spawn`` their children's default."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else None


def _worker_init(parent: int, rank: int, worker_id: int) -> None:
    die_with_parent(parent)  # a loader process never outlives its training process
    name_process(f"shoal loader {rank}")


class ShardLoader:
    """This rank's training batches (:meth:`epoch`) and test shard (:meth:`test_batches`),
    read here (``workers`` 0) or by that many background processes; :meth:`close` stops
    them."""

    def __init__(self, data: Dataset, plan: EpochPlan, rank: int, workers: int = 0, *,
                 pin_memory: bool = False, seed: int = 0) -> None:
        self.plan, self.rank, self.seed, self.workers = plan, rank, seed, workers
        self.test_size = len(data.test)
        self._rows = _Rows({"train": data.train, "test": data.test})
        self._keys = _Keys()
        self._loader: DataLoader | None = None
        if workers:
            # The generator only seeds the workers' own generators, which the batches do not
            # use (see seeded); given, so that starting a pass draws nothing from the caller's.
            self._loader = DataLoader(
                self._rows, sampler=self._keys, batch_size=None, num_workers=workers,
                pin_memory=pin_memory, persistent_workers=True, prefetch_factor=PREFETCH,
                worker_init_fn=functools.partial(_worker_init, os.getpid(), rank),
                generator=torch.Generator().manual_seed(seed),
                multiprocessing_context=_start_method())

    def _read(self, keys: Iterable[Any]) -> Iterator[Batch]:
        if self._loader is None:
            return (self._rows[key] for key in keys)
        self._keys.keys = keys
        return _unwrapped(iter(self._loader))  # persistent workers: a new pass, new keys


    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """This rank's batches of ``epoch`` from step ``start`` on: ``(x, y, global batch)``."""
        plan, perm = self.plan, self.plan.permutation(epoch)
        steps = range(start, plan.steps_per_epoch)
        keys = (("train", plan.local(perm, step, self.rank)[0].tolist(),
                 batch_seed(self.seed, epoch, step, self.rank)) for step in steps)
        for step, (x, y) in zip(steps, self._read(keys), strict=True):
            begin, end = plan.bounds[step]
            yield x, y, end - begin

    def test_batches(self, batch: int, world: int, rank: int | None = None) -> Iterator[Batch]:
        """Shard ``rank`` (this loader's rank by default) of the test set's ``world``
        contiguous shards, ``batch`` rows at a time."""
        lo, hi = shard_range(self.test_size, world, self.rank if rank is None else rank)
        return self._read(("test", list(range(s, min(s + batch, hi))), batch_seed(self.seed, s))
                          for s in range(lo, hi, batch))

    def close(self) -> None:
        """Stop the background processes (they would also end with this process)."""
        it = getattr(self._loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()  # what the iterator's __del__ does, now rather than at GC
            self._loader._iterator = None  # type: ignore[union-attr]


def _unwrapped(batches: Iterator[Batch]) -> Iterator[Batch]:
    """``batches``, a loader process's error as its own line: the DataLoader re-raises it
    with the process's traceback as the message, its last line ``...ShoalError: what``."""
    try:
        yield from batches
    except ShoalError as exc:
        last = str(exc).strip().splitlines()[-1]
        raise ShoalError(last.partition("ShoalError: ")[2] or last) from None
