"""Datasets by name, rank-agnostic: a loader returns whole splits; sharding picks each rank's rows.

Built in: ``digits`` (bundled), ``synthetic``, ``mnist``, ``fashion-mnist``, ``cifar10``,
``npz:PATH`` and ``imagefolder:PATH``; a user's ``pkg.module:factory`` or ``file.py:factory``
(:mod:`shoal.data.user`). :func:`register_dataset` adds one. :class:`ShardLoader` reads a
rank's batches, in the training process or in background processes.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.data import cifar, digits, idx, imagefolder, npz, synthetic
from shoal.data.base import DataOptions, Dataset, Split, TensorSplit, num_rows, take_rows
from shoal.data.loader import ShardLoader, resolve_workers
from shoal.data.sharding import EpochPlan, shard_range, split_sizes
from shoal.data.user import OBJECT_PREFIX, MapSplit, as_dataset, load_factory
from shoal.errors import ShoalError

Loader = Callable[[DataOptions], Dataset]
PathLoader = Callable[[str, DataOptions], Dataset]

DATASETS: dict[str, Loader] = {
    "digits": digits.load,
    "synthetic": synthetic.load,
    "mnist": idx.load_mnist,
    "fashion-mnist": idx.load_fashion_mnist,
    "cifar10": cifar.load,
}
PATH_DATASETS: dict[str, PathLoader] = {
    "npz": npz.load_path,
    "imagefolder": imagefolder.load_path,
}


def register_dataset(name: str, loader: Loader) -> None:
    """Make ``--dataset name`` load with ``loader(options) -> Dataset``."""
    DATASETS[name] = loader


def dataset_names() -> list[str]:
    return sorted(DATASETS) + [f"{k}:PATH" for k in sorted(PATH_DATASETS)] + \
        ["pkg.module:factory", "file.py:factory"]


def load_dataset(spec: str, opts: DataOptions | None = None) -> Dataset:
    """Load the dataset named by ``spec`` (``digits``, ``npz:/data/x.npz``, ``my.mod:make``)."""
    opts = opts or DataOptions()
    kind, sep, path = spec.partition(":")
    if sep and kind in PATH_DATASETS:
        if not path:
            raise ShoalError(f"dataset {spec!r} needs a path after '{kind}:'")
        return PATH_DATASETS[kind](path, opts)
    if spec in DATASETS:
        return DATASETS[spec](opts)
    if spec.startswith(OBJECT_PREFIX):
        raise ShoalError(f"dataset {spec!r} was given as a Python object; give it again "
                         "(shoal.train.train(cfg, dataset=...)) or name a factory")
    if sep and kind and path:
        return load_factory(spec, opts)
    raise ShoalError(f"unknown dataset {spec!r}; choose from {', '.join(dataset_names())}")


__all__ = [
    "DATASETS", "OBJECT_PREFIX", "DataOptions", "Dataset", "EpochPlan", "MapSplit", "ShardLoader",
    "Split", "TensorSplit", "as_dataset", "dataset_names", "load_dataset", "num_rows",
    "register_dataset", "resolve_workers", "shard_range", "split_sizes", "take_rows",
]
