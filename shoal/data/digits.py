"""scikit-learn's 8x8 handwritten digits: 1797 images, shipped inside scikit-learn itself.

The images are read straight from scikit-learn's own data file
(``sklearn/datasets/data/digits.csv.gz``, found without importing scikit-learn: the import
costs about a second of CPU in every process that loads the data, and every worker does) and
split as scikit-learn's ``train_test_split(test_size=0.2, random_state=0, stratify=y)``
splits them, with the row order of that split stored in ``digits_split.txt`` beside this
file. tests/test_data.py checks both against scikit-learn itself.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from shoal.data.base import DataOptions, Dataset, to_splits
from shoal.errors import ShoalError

SPLIT = Path(__file__).with_name("digits_split.txt")


def data_file() -> Path:
    """scikit-learn's ``digits.csv.gz`` (64 pixels and the label a row)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ShoalError("dataset digits comes with scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise ShoalError(f"dataset digits: scikit-learn has no {path}")
    return path


def load(opts: DataOptions) -> Dataset:
    """A fixed stratified 80/20 split (1437 train, 360 test), pixels scaled from 0..16."""
    rows = np.loadtxt(data_file(), delimiter=",", dtype=np.float32)
    x, y = rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)
    train, test = (np.array(line.split(), dtype=np.int64)
                   for line in SPLIT.read_text().splitlines() if not line.startswith("#"))
    return to_splits("digits", x[train], y[train], x[test], y[test], scale=1 / 16)
