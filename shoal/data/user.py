"""A user's own data: ``--dataset pkg.module:factory`` (or ``path/to/file.py:factory``), or
dataset objects handed to :func:`shoal.train.train` in Python.

The contract (docs/data.md): ``factory()`` returns the training and test splits as map-style
``torch.utils.data.Dataset`` objects (``len(ds)`` and ``ds[i] -> (input, label)``: the input a
tensor, or anything ``default_collate`` stacks into one, the label an integer class number)
in one of these forms:

- ``(train, test)``;
- ``(train, test, input_shape, num_classes)``;
- ``{"train": ..., "test": ..., "input_shape": ..., "num_classes": ...}`` (the last two
  optional);
- a :class:`shoal.data.Dataset` (a train and a test :class:`~shoal.data.Split` with their
  shape and classes).

The factory may take any of the keywords ``data_dir``, ``seed`` and ``image_size`` (the
``--data-dir``, ``--seed`` and ``--image-size`` settings). Without ``input_shape`` it is the
first training input's shape; without ``num_classes`` the training labels are read (the
``targets`` attribute when the dataset has one, as torchvision's have, else every sample) and
checked with the rule of every labelled dataset (:func:`~shoal.data.base.count_classes`).
Anything else is one error line, in the launcher, before any worker starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shoal.data.base import DataOptions, Dataset, Split, count_classes, label_vector
from shoal.errors import ShoalError
from shoal.loading import exited, load_object, one_line

#: The settings a factory may ask for by naming them as parameters.
FACTORY_KEYWORDS = ("data_dir", "seed", "image_size")
#: The keys a factory's dict may hold.
DICT_KEYS = ("train", "test", "input_shape", "num_classes")
#: The name (and ``--dataset``) of data given as Python objects: ``<object TrainType>``.
OBJECT_PREFIX = "<object "
FORMS = ("(train, test), (train, test, input_shape, num_classes), a dict with train and test, "
         "or a shoal.data.Dataset")


class MapSplit(Split):
    """A map-style torch ``Dataset`` as a shoal split: a batch is its items ``ds[i]``,
    stacked by ``default_collate``; labels become int64 and are checked against the classes,
    float64 inputs become float32 (the models' dtype)."""

    #: The dataset's own transforms may draw random numbers: the loader seeds them per batch.
    draws_random = True

    def __init__(self, dataset: Any, name: str, num_classes: int | None = None) -> None:
        self.dataset, self.name, self.num_classes = dataset, name, num_classes
        #: Indexing an in-memory TensorDataset is as cheap as a loader's message.
        self.in_memory = isinstance(dataset, torch.utils.data.TensorDataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def item(self, i: int) -> tuple[Any, Any]:
        """Sample ``i`` as its ``(input, label)`` pair, or a one-line error."""
        try:
            item = self.dataset[i]
        except ShoalError:
            raise
        except SystemExit as exc:
            raise ShoalError(f"{self.name}: reading sample {i} {exited(exc)}") from exc
        except Exception as exc:
            raise ShoalError(f"{self.name}: reading sample {i} failed: {one_line(exc)}") from exc
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            what = f"a {len(item)}-tuple" if isinstance(item, (tuple, list)) else \
                _a(type(item).__name__)
            raise ShoalError(f"{self.name}: sample {i} is {what}; expected a pair (input, label)")
        return item[0], item[1]

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate

        rows = idx.tolist()
        items = [self.item(i) for i in rows]
        try:
            x, y = default_collate(items)
        except Exception as exc:
            raise ShoalError(f"{self.name}: samples {_rows(rows)} do not stack into one batch "
                             f"({one_line(exc)}); inputs must be tensors (or arrays) of one "
                             "shape, labels integers") from exc
        if not isinstance(x, torch.Tensor):
            raise ShoalError(f"{self.name}: inputs must be tensors (or arrays), "
                             f"got {type(items[0][0]).__name__}")
        if x.dtype == torch.float64:
            x = x.float()
        y = torch.as_tensor(y)
        whole = not y.dtype.is_floating_point or bool((y == y.round()).all())  # 3.0: class 3
        if y.ndim != 1 or not whole or y.dtype.is_complex or y.dtype == torch.bool:
            raise ShoalError(f"{self.name}: labels must be integer class numbers, got "
                             f"{type(items[0][1]).__name__} {show_label(items[0][1])}")
        y = y.long()
        if self.num_classes is not None:
            bad = ((y < 0) | (y >= self.num_classes)).nonzero()
            if len(bad):
                first = int(bad[0])
                raise ShoalError(f"{self.name}: sample {rows[first]} has label {int(y[first])}, "
                                 f"not a class in 0..{self.num_classes - 1}")
        return x, y


def _a(noun: str) -> str:
    """``a dict``, ``an int``."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _rows(rows: list[int]) -> str:
    return ", ".join(map(str, rows[:3])) + (f" and {len(rows) - 3} more" if len(rows) > 3 else "")


def show_label(label: Any) -> str:
    text = repr(label.tolist() if isinstance(label, (torch.Tensor, np.ndarray)) else label)
    return text if len(text) <= 40 else text[:37] + "..."


def load_factory(spec: str, opts: DataOptions) -> Dataset:
    """``--dataset pkg.module:factory``: import the factory, call it, check what it returns."""
    factory = load_object(spec, "dataset")
    if not callable(factory):
        raise ShoalError(f"dataset {spec!r} is {_a(type(factory).__name__)}, not a function "
                         f"returning {FORMS}")
    return as_dataset(_call(factory, spec, opts), f"dataset {spec!r}", spec)


def _call(factory: Callable[..., Any], spec: str, opts: DataOptions) -> Any:
    """``factory(**the settings it names)``, its failures as one line."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        params = {}
    everything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: getattr(opts, k) for k in FACTORY_KEYWORDS if everything or k in params}
    try:
        return factory(**kwargs)
    except ShoalError:
        raise
    except SystemExit as exc:
        raise ShoalError(f"dataset {spec!r} {exited(exc)} while loading") from exc
    except Exception as exc:
        raise ShoalError(f"dataset {spec!r} failed to load: {one_line(exc)}") from exc


def as_dataset(obj: Any, source: str = "dataset", name: str | None = None) -> Dataset:
    """``obj`` (any of the module docstring's forms) as a checked :class:`Dataset`; errors
    begin with ``source`` (``dataset 'my.mod:make'``). ``name`` names the dataset in the
    run's first line (default: the train split's type)."""
    if isinstance(obj, Dataset):
        return obj
    if isinstance(obj, dict):
        unknown = [str(k) for k in obj if k not in DICT_KEYS]
        missing = [k for k in ("train", "test") if k not in obj]
        if unknown or missing:
            problem = f"unknown keys {', '.join(unknown)}" if unknown else \
                f"no {' and no '.join(missing)}"
            raise ShoalError(f"{source} returned a dict with {problem}; its keys are "
                             f"{', '.join(DICT_KEYS)} (the last two optional)")
        train, test = obj["train"], obj["test"]
        shape, classes = obj.get("input_shape"), obj.get("num_classes")
    elif isinstance(obj, (tuple, list)) and len(obj) in (2, 4):
        train, test, shape, classes = (*obj, None, None)[:4]
    else:
        what = f"a {len(obj)}-tuple" if isinstance(obj, (tuple, list)) else \
            _a(type(obj).__name__)
        raise ShoalError(f"{source} returned {what}; expected {FORMS}")
    name = name or f"{OBJECT_PREFIX}{type(train).__name__}>"
    train_split = _split(train, f"{source} (train)")
    test_split = _split(test, f"{source} (test)")
    first = _first_input(train_split, f"{source} (train)")
    test_first = _first_input(test_split, f"{source} (test)")
    if shape is None:
        shape = tuple(first.shape)
    shape = _shape(shape, source)
    if tuple(first.shape) != shape:
        raise ShoalError(f"{source}: input_shape is {_show(shape)} but training sample 0 has "
                         f"shape {_show(tuple(first.shape))}")
    if tuple(test_first.shape) != shape:
        raise ShoalError(f"{source}: test sample 0 has shape {_show(tuple(test_first.shape))}, "
                         f"training samples {_show(shape)}")
    if classes is None:
        classes = count_classes(f"{source} (train)", _labels(train_split),
                                f"{source} (test)", _labels(test_split))
    elif isinstance(classes, bool) or not isinstance(classes, (int, np.integer)) or classes < 1:
        raise ShoalError(f"{source}: num_classes must be a positive integer, got {classes!r}")
    for split in (train_split, test_split):
        if isinstance(split, MapSplit):
            split.num_classes = int(classes)
    return Dataset(name, train_split, test_split, shape, int(classes))


def _split(ds: Any, source: str) -> Split:
    """A map-style dataset (or a shoal Split) as a non-empty :class:`Split`."""
    if isinstance(ds, torch.utils.data.IterableDataset):
        raise ShoalError(f"{source} is an IterableDataset; shoal shards by index and needs a "
                         "map-style Dataset (len(ds) and ds[i])")
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")) or isinstance(
            ds, (str, bytes, dict, torch.Tensor, np.ndarray)):
        raise ShoalError(f"{source} is {_a(type(ds).__name__)}, not a map-style torch Dataset "
                         "(len(ds) and ds[i] -> (input, label))")
    split = ds if isinstance(ds, Split) else MapSplit(ds, source)
    try:
        n = len(split)
    except Exception as exc:
        raise ShoalError(f"{source}: len() failed: {one_line(exc)}") from exc
    if n == 0:
        raise ShoalError(f"{source} is empty")
    return split


def _first_input(split: Split, source: str) -> torch.Tensor:
    """The first sample's input (read as a batch of one, as training reads it)."""
    if isinstance(split, MapSplit):
        split.item(0)  # its own error for a sample that is no pair
    x, _ = split.get_batch(torch.tensor([0]))
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        raise ShoalError(f"{source}: inputs must be tensors with at least one dimension "
                         "(a vector of features, an image)")
    return x[0]


def _labels(split: Split) -> np.ndarray:
    """Every label of ``split``: its dataset's ``targets`` when it has them, else read."""
    source = split.name if isinstance(split, MapSplit) else f"{type(split).__name__} labels"
    if isinstance(split, MapSplit):
        targets = getattr(split.dataset, "targets", None)
        if targets is not None and _length(targets) == len(split):
            return label_vector(source, np.asarray(targets))
        labels = [split.item(i)[1] for i in range(len(split))]
    else:
        labels = [split.get_batch(torch.tensor([i]))[1] for i in range(len(split))]
    return label_vector(source, np.asarray([_scalar(y, source, i) for i, y in enumerate(labels)]))


def _scalar(label: Any, source: str, i: int) -> Any:
    """A label as a plain number (:func:`label_vector` checks which kind)."""
    if isinstance(label, (torch.Tensor, np.ndarray)):
        size = label.size if isinstance(label, np.ndarray) else label.numel()
        if size != 1:
            raise ShoalError(f"{source}: sample {i}'s label has shape {tuple(label.shape)}; "
                             "labels are class numbers")
        return label.item()
    return label.item() if isinstance(label, np.generic) else label


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def _shape(shape: Any, source: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
        ok = all(int(d) == d and d >= 1 for d in shape) and bool(dims)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ShoalError(f"{source}: input_shape must be positive sizes like (3, 32, 32), "
                         f"got {shape!r}")
    return dims


def _show(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "a scalar"
