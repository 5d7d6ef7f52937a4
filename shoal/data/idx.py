"""MNIST and Fashion-MNIST from their IDX files (optionally gzipped) in ``--data-dir``.

The files are looked for in ``--data-dir`` itself and in torchvision's layout
(``MNIST/raw``, ``FashionMNIST/raw``), so a directory torchvision downloaded works as is.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from shoal.data.base import DataOptions, Dataset, to_splits
from shoal.errors import ShoalError

_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (the format of LeCun's MNIST distribution)."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ShoalError(f"{path}: cannot read: {exc}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ShoalError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise ShoalError(f"{path}: truncated IDX header")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_DTYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ShoalError(f"{path}: IDX header promises {dims} ({expected} bytes of data) "
                         f"but the file holds {len(raw) - header}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).copy()


def _find(root: Path, subdir: str, stem: str) -> Path:
    for folder in (root, root / subdir / "raw", root / subdir):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    raise ShoalError(f"missing {stem}[.gz] in {root} (nor in {root / subdir / 'raw'})")


def _loader(name: str, subdir: str):
    def load(opts: DataOptions) -> Dataset:
        root = opts.require_dir(name)
        paths = {key: _find(root, subdir, stem) for key, stem in _FILES.items()}
        arrays = {key: read_idx(path) for key, path in paths.items()}
        for split in ("train", "test"):
            x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
            if x.ndim != 3:
                raise ShoalError(f"{name}: {split} images must be 3-D (N, H, W), got {x.shape}")
            if len(x) != len(y):
                raise ShoalError(f"{name}: {len(x)} {split} images but {len(y)} labels")
        return to_splits(name, arrays["x_train"], arrays["y_train"], arrays["x_test"],
                         arrays["y_test"], scale=1 / 255,
                         label_sources=(str(paths["y_train"]), str(paths["y_test"])))

    load.__doc__ = f"{name} from IDX files in --data-dir."
    return load


load_mnist = _loader("mnist", "MNIST")
load_fashion_mnist = _loader("fashion-mnist", "FashionMNIST")
