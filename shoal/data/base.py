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

    #: Held in memory: reading a batch costs less than receiving it from a loader process.
    in_memory = False
    #: Reading a batch draws random numbers (a user's transforms); the loader seeds them.
    draws_random = False

    def __len__(self) -> int:
        raise NotImplementedError

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TensorSplit(Split):
    """A split held in memory as two tensors (inputs ``x``, integer labels ``y``)."""

    in_memory = True

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
    synthetic_noise: float = 1.5

    def require_dir(self, dataset: str) -> Path:
        if not self.data_dir:
            raise ShoalError(f"dataset {dataset} needs --data-dir")
        path = Path(self.data_dir)
        if not path.is_dir():
            raise ShoalError(f"--data-dir {path} is not a directory")
        return path


#: The largest label accepted: beyond it a float no longer holds every whole number, and no
#: training split could hold a sample of every class below it anyway.
MAX_LABEL = 2**53


def label_vector(source: str, y: Any, rows: int | None = None) -> np.ndarray:
    """``y`` as an int64 vector of class numbers, or a one-line error naming ``source``.

    ``source`` names where the labels come from (a file, or a file and the array in it). Any
    signed or unsigned integer dtype is accepted, and floats whose values are all whole
    numbers (``3.0``); booleans, text and other dtypes, NaN, infinities, fractions, negative
    labels and labels over :data:`MAX_LABEL` are refused. With ``rows`` the vector must hold
    exactly that many labels.
    """
    y = np.asarray(y)
    if y.ndim != 1 or (rows is not None and len(y) != rows):
        count = f"{rows} " if rows is not None else ""
        raise ShoalError(f"{source}: labels must be a vector of {count}integers, "
                         f"got shape {y.shape}")
    if y.dtype.kind == "b":
        raise ShoalError(f"{source}: labels are booleans; store the class numbers 0..C-1 "
                         "as integers")
    if y.dtype.kind not in "iuf":
        raise ShoalError(f"{source}: labels must be integer class numbers, got {y.dtype}")
    if y.dtype.kind == "f":
        _refuse_rows(source, ~(np.isfinite(y) & (np.floor(y) == y)),
                     "is not a whole number", "such labels", y)
    if y.dtype.kind != "u":
        _refuse_rows(source, y < 0, "is negative", "negative labels", y,
                     "; classes are numbered from 0")
    _refuse_rows(source, y > MAX_LABEL, "is too large to be a class number", "such labels", y)
    return y.astype(np.int64)


def _refuse_rows(source: str, bad: np.ndarray, problem: str, many: str, y: np.ndarray,
                 hint: str = "") -> None:
    """Raise naming the first row where ``bad`` holds, and how many rows it holds for."""
    rows = np.flatnonzero(bad)
    if len(rows):
        first = rows[0]
        count = f" ({len(rows)} {many})" if len(rows) > 1 else ""
        raise ShoalError(f"{source}: label {y[first].item()} at row {first} {problem}"
                         f"{count}{hint}")


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _listing(items: list[str], what: str, limit: int = 5) -> str:
    """``items`` joined by commas, the ones past ``limit`` counted (``and 3 more what``)."""
    if len(items) <= limit:
        return ", ".join(items)
    return ", ".join(items[:limit]) + f" and {len(items) - limit} more {what}"


def _samples(n: int) -> str:
    return f"{n} sample" if n == 1 else f"{n} samples"


def _runs(classes: np.ndarray, counts: np.ndarray) -> list[str]:
    """Runs of consecutive ``classes`` (sorted, distinct) with their sample counts:
    ``0..2 with 13-14 samples each``, ``100000 with 1 sample``."""
    breaks = np.flatnonzero(np.diff(classes) != 1) + 1
    runs = []
    for lo, hi in zip(np.r_[0, breaks], np.r_[breaks, len(classes)], strict=True):
        few, many = int(counts[lo:hi].min()), int(counts[lo:hi].max())
        if hi - lo == 1:
            runs.append(f"{classes[lo]} with {_samples(few)}")
        else:
            n = f"{few}-{many}" if few != many else str(few)
            runs.append(f"{_span(int(classes[lo]), int(classes[hi - 1]))} with {n} samples each")
    return runs


def count_classes(train_source: str, y_train: np.ndarray, test_source: str,
                  y_test: np.ndarray) -> int:
    """The number of classes C of int64 label vectors (see :func:`label_vector`).

    The rule: the classes are 0..C-1, C-1 being the largest *training* label; every one of
    them has at least one training sample; every test label is one of them (a test split
    need not hold every class). Anything else is a one-line error naming the source, the
    classes without a training sample or the test-only classes, and the labels found.
    """
    if not len(y_train):
        raise ShoalError(f"{train_source}: no training labels")
    classes, counts = np.unique(y_train, return_counts=True)
    num_classes = int(classes[-1]) + 1
    missing = num_classes - len(classes)
    if missing:
        starts = np.r_[0, classes[:-1] + 1]  # each present class closes a gap before it
        gaps = [_span(int(lo), int(hi) - 1) for lo, hi in zip(starts, classes, strict=True)
                if hi > lo]
        which = f"class {gaps[0]}" if missing == 1 else f"classes {_listing(gaps, 'gaps')}"
        if len(gaps) > 5:
            which = f"{missing} classes, namely {_listing(gaps, 'gaps')}"
        found = _listing(_runs(classes, counts), "runs")
        raise ShoalError(
            f"{train_source}: no training sample for {which} (labels found: {found}); the "
            "classes must be 0..C-1 with C-1 the largest training label, each with a training "
            "sample")
    test_classes, test_counts = np.unique(y_test, return_counts=True)
    unseen = test_classes >= num_classes
    if unseen.any():
        listed = [f"{c} ({_samples(int(n))})"
                  for c, n in zip(test_classes[unseen], test_counts[unseen], strict=True)]
        plural = len(listed) > 1
        raise ShoalError(
            f"{test_source}: class{'es' if plural else ''} {_listing(listed, 'classes')} "
            f"never appear{'' if plural else 's'} in training ({train_source} has classes "
            f"{_span(0, num_classes - 1)})")
    return num_classes


def to_splits(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    scale: float | None = None,
    standardize: bool = True,
    label_sources: tuple[str, str] | None = None,
) -> Dataset:
    """Build an in-memory :class:`Dataset` from arrays, checking shapes and labels.

    Images come as ``(N, H, W)`` or ``(N, C, H, W)``; flat features as ``(N, D)``. With
    ``scale`` inputs are multiplied by it first (e.g. 1/255); with ``standardize`` each channel
    is shifted and scaled to zero mean and unit variance using the *training* statistics.
    Labels are checked and counted with :func:`label_vector` and :func:`count_classes`;
    ``label_sources`` names where the train and test labels come from in their errors.
    """
    if x_train.ndim == 3:
        x_train, x_test = x_train[:, None], x_test[:, None]
    if x_train.ndim not in (2, 4):
        raise ShoalError(f"{name}: inputs must be (N, D), (N, H, W) or (N, C, H, W), "
                         f"got shape {x_train.shape}")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ShoalError(f"{name}: train inputs {x_train.shape[1:]} and test inputs "
                         f"{x_test.shape[1:]} differ in shape")
    train_source, test_source = label_sources or (f"{name} (train labels)",
                                                  f"{name} (test labels)")
    y_train = label_vector(train_source, y_train, len(x_train))
    y_test = label_vector(test_source, y_test, len(x_test))
    if len(x_train) == 0 or len(x_test) == 0:
        raise ShoalError(f"{name}: train and test splits must not be empty")
    num_classes = count_classes(train_source, y_train, test_source, y_test)
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
    return Dataset(
        name=name,
        train=TensorSplit(xt.contiguous(), torch.from_numpy(y_train)),
        test=TensorSplit(xv.contiguous(), torch.from_numpy(y_test)),
        input_shape=tuple(xt.shape[1:]),
        num_classes=num_classes,
    )
