"""Images in class folders: ``ROOT/train/<class>/*.png`` and ``ROOT/test/<class>/*`` (or ``val``).

The layout of ImageNet and of torchvision's ``ImageFolder``. Images are decoded with Pillow
when a batch asks for them (the set need not fit in memory), resized to ``--image-size``
(default: the first image's size) and standardized with statistics of up to 512 training
images.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shoal.data.base import DataOptions, Dataset, Split
from shoal.errors import ShoalError

EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".webp", ".tif", ".tiff"}


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
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as img:
                img = img.convert(self.mode)
                if img.size != (self.size[1], self.size[0]):
                    img = img.resize((self.size[1], self.size[0]), Image.BILINEAR)
                arr = np.asarray(img, dtype=np.float32) / 255.0
        except (OSError, UnidentifiedImageError) as exc:
            raise ShoalError(f"{path}: cannot decode image ({exc})") from None
        return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)

    def raw_batch(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.stack([self._read(self.files[i]) for i in idx.tolist()]))

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.raw_batch(idx) - self.mean) / self.std, self.labels.index_select(0, idx)


def _scan(folder: Path, classes: list[str]) -> tuple[list[Path], list[int]]:
    files, labels = [], []
    for label, cls in enumerate(classes):
        d = folder / cls
        if not d.is_dir():
            continue
        for f in sorted(d.rglob("*")):
            if f.suffix.lower() in EXTENSIONS and f.is_file():
                files.append(f)
                labels.append(label)
    return files, labels


def load_path(path: str, opts: DataOptions) -> Dataset:
    from PIL import Image, UnidentifiedImageError

    root = Path(path)
    if not (root / "train").is_dir():
        raise ShoalError(f"image folder {root} has no train/ directory")
    test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if test_dir is None:
        raise ShoalError(f"image folder {root} has no test/ or val/ directory")
    classes = sorted(d.name for d in (root / "train").iterdir() if d.is_dir())
    if len(classes) < 2:
        raise ShoalError(f"image folder {root / 'train'} needs at least 2 class directories")
    extra = sorted(d.name for d in test_dir.iterdir() if d.is_dir() and d.name not in classes)
    if extra:
        raise ShoalError(f"{test_dir} has classes not in train/: {', '.join(extra)}")
    train_files, train_labels = _scan(root / "train", classes)
    test_files, test_labels = _scan(test_dir, classes)
    if not train_files or not test_files:
        raise ShoalError(f"image folder {root}: no images found in train/ or {test_dir.name}/")
    try:
        with Image.open(train_files[0]) as first:
            mode = "L" if first.mode in ("L", "1", "I;16", "I") else "RGB"
            size = (first.height, first.width)
    except (OSError, UnidentifiedImageError) as exc:
        raise ShoalError(f"{train_files[0]}: cannot decode image ({exc})") from None
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
