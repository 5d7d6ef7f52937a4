"""CIFAR-10 from the "python version" batches (``data_batch_1..5``, ``test_batch``).

The batches are pickles. Unpickling can run arbitrary code, so they are read with an
unpickler that only rebuilds plain containers and numpy arrays and refuses anything else.
"""

from __future__ import annotations

import codecs
import io
import pickle
from pathlib import Path

import numpy as np

from shoal.data.base import DataOptions, Dataset, label_vector, to_splits
from shoal.errors import ShoalError

# numpy's array and scalar rebuilders live in numpy.core (1.x) or numpy._core (2.x); take them
# from numpy's own __reduce__ rather than importing a private module by name.
_reconstruct = np.zeros(1).__reduce__()[0]
_scalar = np.int64(0).__reduce__()[0]
_ALLOWED = {
    **{(mod, "_reconstruct"): _reconstruct for mod in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(mod, "scalar"): _scalar for mod in ("numpy.core.multiarray", "numpy._core.multiarray")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle protocol
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}") from None


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch file as ``(images (N, 3, 32, 32) uint8, labels (N,) int64)``."""
    try:
        obj = _RestrictedUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except OSError as exc:
        raise ShoalError(f"{path}: cannot read: {exc}") from None
    except Exception as exc:  # any unpickling failure means a corrupt or foreign file
        raise ShoalError(f"{path}: not a CIFAR-10 batch ({exc})") from None
    if not isinstance(obj, dict):
        raise ShoalError(f"{path}: not a CIFAR-10 batch (top level is {type(obj).__name__})")
    batch = {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}
    if "data" not in batch or "labels" not in batch:
        raise ShoalError(f"{path}: not a CIFAR-10 batch (no 'data' and 'labels')")
    data, labels = np.asarray(batch["data"]), np.asarray(batch["labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ShoalError(f"{path}: data must be uint8 of shape (N, 3072), got "
                         f"{data.dtype} {data.shape}")
    if labels.shape != (len(data),):
        raise ShoalError(f"{path}: {len(data)} images but {labels.size} labels")
    return data.reshape(-1, 3, 32, 32), label_vector(str(path), labels)


def load(opts: DataOptions) -> Dataset:
    root = opts.require_dir("cifar10")
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise ShoalError(f"cifar10: missing {', '.join(missing)} in {root}")
    parts = [read_batch(root / n) for n in names]
    x_train = np.concatenate([p[0] for p in parts[:5]])
    y_train = np.concatenate([p[1] for p in parts[:5]])
    return to_splits("cifar10", x_train, y_train, parts[5][0], parts[5][1], scale=1 / 255,
                     label_sources=(f"{root / 'data_batch_1'}..5", str(root / "test_batch")))
