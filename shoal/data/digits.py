"""scikit-learn's 8x8 handwritten digits: 1797 images, shipped inside scikit-learn itself."""

from __future__ import annotations

from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from shoal.data.base import DataOptions, Dataset, to_splits


def load(opts: DataOptions) -> Dataset:
    """A fixed stratified 80/20 split (1437 train, 360 test), pixels scaled from 0..16."""
    bunch = load_digits()
    x = bunch.images.astype("float32")  # (1797, 8, 8)
    y = bunch.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )
    return to_splits("digits", x_train, y_train, x_test, y_test, scale=1 / 16)
