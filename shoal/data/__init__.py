"""Datasets by name, rank-agnostic: a loader returns whole splits; sharding picks each rank's rows.

Built in: ``digits`` (bundled), ``synthetic``, ``mnist``, ``fashion-mnist``, ``cifar10``,
``npz:PATH`` and ``imagefolder:PATH``. :func:`register_dataset` adds one.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.data import cifar, digits, idx, imagefolder, npz, synthetic
from shoal.data.base import DataOptions, Dataset, Split, TensorSplit, num_rows, take_rows
from shoal.data.sharding import EpochPlan, shard_range, split_sizes
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
    return sorted(DATASETS) + [f"{k}:PATH" for k in sorted(PATH_DATASETS)]


def load_dataset(spec: str, opts: DataOptions | None = None) -> Dataset:
    """Load the dataset named by ``spec`` (``digits``, ``npz:/data/x.npz``, ...)."""
    opts = opts or DataOptions()
    kind, sep, path = spec.partition(":")
    if sep and kind in PATH_DATASETS:
        if not path:
            raise ShoalError(f"dataset {spec!r} needs a path after '{kind}:'")
        return PATH_DATASETS[kind](path, opts)
    if spec in DATASETS:
        return DATASETS[spec](opts)
    raise ShoalError(f"unknown dataset {spec!r}; choose from {', '.join(dataset_names())}")


__all__ = [
    "DATASETS", "DataOptions", "Dataset", "EpochPlan", "Split", "TensorSplit",
    "dataset_names", "load_dataset", "num_rows", "register_dataset", "shard_range", "split_sizes",
    "take_rows",
]
