"""Images in class folders: ``ROOT/train/<class>/*.png`` and ``ROOT/test/<class>/*`` (or ``val``).

The layout of ImageNet and of torchvision's ``ImageFolder``. Every image, train and test, is
decoded once when the dataset loads, so a corrupt file is an error before training starts.
During training images are decoded again when a batch asks for them (the set need not fit in
memory), resized to ``--image-size`` (default: the first image's size) and standardized with
statistics of up to 512 training images.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from shoal.data.base import DataOptions, Dataset, Split
from shoal.errors import ShoalError

EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".webp", ".tif", ".tiff"}


@contextmanager
def _bombs_are_errors() -> Iterator[None]:
    """Make Pillow's DecompressionBombWarning (an image over ``Image.MAX_IMAGE_PIXELS``
    pixels) an exception, as its DecompressionBombError (over twice that) already is."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


def _cannot_decode(path: Path, exc: BaseException) -> str:
    """One line naming ``path`` and why Pillow could not decode it."""
    lines = str(exc).strip().splitlines()
    return f"{path}: cannot decode image ({lines[0] if lines else type(exc).__name__})"


def _problem(path: Path) -> str | None:
    """Why the image at ``path`` cannot be decoded in full, or ``None`` if it can."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.load()
    except Exception as exc:  # any failure of Pillow on a file makes that file unusable
        return _cannot_decode(path, exc)
    return None


def _problems(paths: list[Path]) -> list[str]:
    return [msg for msg in map(_problem, paths) if msg is not None]


def check_images(files: list[Path], chunk: int = 256) -> None:
    """Decode every one of ``files`` in full; one error line names the first that fails and
    counts the others. Threads share the work: Pillow decodes without holding the GIL."""
    chunks = [files[i : i + chunk] for i in range(0, len(files), chunk)]
    with _bombs_are_errors(), ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        problems = [msg for found in pool.map(_problems, chunks) for msg in found]
    if problems:
        more = len(problems) - 1
        extra = f" (and {more} more unreadable image{'s' if more > 1 else ''})" if more else ""
        raise ShoalError(problems[0] + extra)


class ImageFolderSplit(Split):
    """Image files and their labels, decoded per batch."""

    def __init__(self, files: list[Path], labels: list[int], size: tuple[int, int],
                 mode: str) -> None:
        self.files, self.labels, self.size, self.mode = files, torch.tensor(labels), size, mode
        self.mean = torch.zeros(1)
        self.std = torch.ones(1)

    def __len__(self) -> int:
        return len(self.files)

    def _read(self, path: Path) -> np.ndarray:
        from PIL import Image

        try:
            with Image.open(path) as img:
                img = img.convert(self.mode)
                if img.size != (self.size[1], self.size[0]):
                    img = img.resize((self.size[1], self.size[0]), Image.BILINEAR)
                arr = np.asarray(img, dtype=np.float32) / 255.0
        except Exception as exc:  # e.g. the file changed after it was checked
            raise ShoalError(_cannot_decode(path, exc)) from None
        return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)

    def raw_batch(self, idx: torch.Tensor) -> torch.Tensor:
        with _bombs_are_errors():
            images = [self._read(self.files[i]) for i in idx.tolist()]
        return torch.from_numpy(np.stack(images))

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.raw_batch(idx) - self.mean) / self.std, self.labels.index_select(0, idx)


def _class_dirs(folder: Path) -> list[str]:
    """The class directories in ``folder``, sorted; hidden ones (``.name``) are not classes."""
    return sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))


def _scan(folder: Path, classes: list[str]) -> tuple[list[Path], list[int]]:
    """The images of each class directory in ``folder`` and their labels. A class need not
    have a directory here, but a class directory must hold images."""
    files: list[Path] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        d = folder / cls
        if not d.is_dir():
            continue
        images = [f for f in sorted(d.rglob("*")) if f.suffix.lower() in EXTENSIONS and f.is_file()]
        if not images:
            raise ShoalError(f"{d}: class directory holds no images "
                             f"(none of {' '.join(sorted(EXTENSIONS))})")
        files += images
        labels += [label] * len(images)
    return files, labels


def load_path(path: str, opts: DataOptions) -> Dataset:
    """The image folder at ``path``; its classes are train/'s directories in sorted order."""
    from PIL import Image

    root = Path(path)
    if not (root / "train").is_dir():
        raise ShoalError(f"image folder {root} has no train/ directory")
    test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if test_dir is None:
        raise ShoalError(f"image folder {root} has no test/ or val/ directory")
    classes = _class_dirs(root / "train")
    if len(classes) < 2:
        raise ShoalError(f"image folder {root / 'train'} needs at least 2 class directories")
    extra = [name for name in _class_dirs(test_dir) if name not in classes]
    if extra:
        raise ShoalError(f"{test_dir} has classes not in train/: {', '.join(extra)}")
    train_files, train_labels = _scan(root / "train", classes)
    test_files, test_labels = _scan(test_dir, classes)
    if not test_files:
        raise ShoalError(f"image folder {root}: no images found in {test_dir.name}/")
    check_images(train_files + test_files)
    with Image.open(train_files[0]) as first:
        mode = "L" if first.mode in ("L", "1", "I;16", "I") else "RGB"
        size = (first.height, first.width)
    if opts.image_size:
        size = (opts.image_size, opts.image_size)
    train = ImageFolderSplit(train_files, train_labels, size, mode)
    test = ImageFolderSplit(test_files, test_labels, size, mode)
    sample = torch.linspace(0, len(train) - 1, min(len(train), 512)).long()
    pixels = train.raw_batch(sample)
    mean = pixels.mean(dim=(0, 2, 3), keepdim=True)[0]
    std = pixels.std(dim=(0, 2, 3), keepdim=True)[0].clamp_min(1e-6)
    for split in (train, test):
        split.mean, split.std = mean, std
    shape = (1 if mode == "L" else 3, *size)
    return Dataset(f"imagefolder:{root.name}", train, test, shape, len(classes))
