"""What every dataset provides: two splits that hand out batches by index, and their shape."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.errors import ShoalError


class Split:
    """A labelled set of samples; :meth:`get_batch` returns the rows ``idx`` as tensors."""

    def __len__(self) -> int:
        raise NotImplementedError

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TensorSplit(Split):
    """A split held in memory as two tensors (inputs ``x``, integer labels ``y``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ShoalError(f"{len(x)} inputs but {len(y)} labels")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x.index_select(0, idx), self.y.index_select(0, idx)


def _is_tensor_columns(data: Any) -> bool:
    """Whether ``data`` is a non-empty tuple or list of tensors, one per column."""
    return isinstance(data, (tuple, list)) and bool(data) and all(
        isinstance(t, torch.Tensor) for t in data)


def num_rows(data: Any) -> int:
    """How many samples ``data`` holds (see :func:`take_rows` for what ``data`` may be)."""
    if _is_tensor_columns(data):
        sizes = {len(t) for t in data}
        if len(sizes) != 1:
            raise ShoalError(f"tensors of one dataset must have as many rows, got {sorted(sizes)}")
        return sizes.pop()
    try:
        return len(data)
    except TypeError:
        raise ShoalError(f"cannot take batches from a {type(data).__name__}: give a shoal Split, "
                         "a tuple of tensors or a map-style torch Dataset") from None


def take_rows(data: Any, idx: torch.Tensor) -> Any:
    """Rows ``idx`` of ``data`` as one batch.

    ``data`` is a :class:`Split` (its ``get_batch``), a tuple of tensors of equal length (each
    indexed) or a map-style ``torch.utils.data.Dataset`` (items collated with PyTorch's
    ``default_collate``).
    """
    if hasattr(data, "get_batch"):
        return data.get_batch(idx)
    if _is_tensor_columns(data):
        return tuple(t.index_select(0, idx) for t in data)
    from torch.utils.data import default_collate

    return default_collate([data[i] for i in idx.tolist()])


@dataclass
class Dataset:
    """A train and a test split, the shape of one input and the number of classes."""

    name: str
    train: Split
    test: Split
    input_shape: tuple[int, ...]
    num_classes: int

    def describe(self) -> str:
        shape = "x".join(map(str, self.input_shape))
        return (f"{self.name}: {len(self.train)} train / {len(self.test)} test samples, "
                f"input {shape}, {self.num_classes} classes")


@dataclass
class DataOptions:
    """The settings a dataset loader may need (taken from the training config)."""

    data_dir: str | None = None
    seed: int = 0
    synthetic_shape: tuple[int, ...] = (3, 32, 32)
    synthetic_classes: int = 10
    synthetic_samples: int = 2048
    image_size: int | None = None

    def require_dir(self, dataset: str) -> Path:
        if not self.data_dir:
            raise ShoalError(f"dataset {dataset} needs --data-dir")
        path = Path(self.data_dir)
        if not path.is_dir():
            raise ShoalError(f"--data-dir {path} is not a directory")
        return path


def to_splits(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    scale: float | None = None,
    standardize: bool = True,
) -> Dataset:
    """Build an in-memory :class:`Dataset` from arrays, checking shapes and labels.

    Images come as ``(N, H, W)`` or ``(N, C, H, W)``; flat features as ``(N, D)``. With
    ``scale`` inputs are multiplied by it first (e.g. 1/255); with ``standardize`` each channel
    is shifted and scaled to zero mean and unit variance using the *training* statistics.
    """
    if x_train.ndim == 3:
        x_train, x_test = x_train[:, None], x_test[:, None]
    if x_train.ndim not in (2, 4):
        raise ShoalError(f"{name}: inputs must be (N, D), (N, H, W) or (N, C, H, W), "
                         f"got shape {x_train.shape}")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ShoalError(f"{name}: train inputs {x_train.shape[1:]} and test inputs "
                         f"{x_test.shape[1:]} differ in shape")
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if y.ndim != 1 or len(y) != len(x):
            raise ShoalError(f"{name}: {split} labels must be a vector of {len(x)} "
                             f"integers, got shape {y.shape}")
        if not np.issubdtype(y.dtype, np.integer):
            raise ShoalError(f"{name}: {split} labels must be integers, got {y.dtype}")
        if len(y) and y.min() < 0:
            raise ShoalError(f"{name}: {split} labels must be >= 0, found {y.min()}")
    if len(x_train) == 0 or len(x_test) == 0:
        raise ShoalError(f"{name}: train and test splits must not be empty")
    xt = torch.from_numpy(np.ascontiguousarray(x_train)).float()
    xv = torch.from_numpy(np.ascontiguousarray(x_test)).float()
    if scale is not None:
        xt, xv = xt * scale, xv * scale
    if not (torch.isfinite(xt).all() and torch.isfinite(xv).all()):
        raise ShoalError(f"{name}: inputs contain NaN or infinite values")
    if standardize:
        dims = [0] + list(range(2, xt.ndim)) if xt.ndim == 4 else [0]
        mean = xt.mean(dim=dims, keepdim=True)
        std = xt.std(dim=dims, keepdim=True).clamp_min(1e-6)
        xt, xv = (xt - mean) / std, (xv - mean) / std
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    return Dataset(
        name=name,
        train=TensorSplit(xt.contiguous(), torch.from_numpy(y_train.astype(np.int64))),
        test=TensorSplit(xv.contiguous(), torch.from_numpy(y_test.astype(np.int64))),
        input_shape=tuple(xt.shape[1:]),
        num_classes=num_classes,
    )
