"""Any labelled arrays saved with ``numpy.savez``: ``x_train, y_train, x_test, y_test``."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from shoal.data.base import DataOptions, Dataset, to_splits
from shoal.errors import ShoalError

KEYS = ("x_train", "y_train", "x_test", "y_test")


def load_path(path: str, opts: DataOptions) -> Dataset:
    """Integer (uint8) images are scaled by 1/255 and standardized; float arrays are used as is.

    Labels follow :func:`shoal.data.base.count_classes`; errors name the file and the array.
    """
    p = Path(path)
    if not p.is_file():
        raise ShoalError(f"npz file {p} does not exist")
    try:
        with np.load(p, allow_pickle=False) as f:
            missing = [k for k in KEYS if k not in f.files]
            if missing:
                raise ShoalError(f"{p}: missing arrays {', '.join(missing)} "
                                 f"(has {', '.join(f.files) or 'none'})")
            arrays = {k: f[k] for k in KEYS}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ShoalError(f"{p}: not a readable .npz file ({exc})") from None
    x = arrays["x_train"]
    integer = np.issubdtype(x.dtype, np.integer)
    return to_splits(f"npz:{p.name}", arrays["x_train"], arrays["y_train"], arrays["x_test"],
                     arrays["y_test"], scale=1 / 255 if integer else None, standardize=integer,
                     label_sources=(f"{p} (y_train)", f"{p} (y_test)"))
