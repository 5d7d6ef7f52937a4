"""Standard image augmentation on whole batches: random horizontal flip and padded crop.

Applied on the training side after a batch is drawn, with each rank's own seeded generator,
so runs are reproducible (``--augment``; the usual CIFAR recipe of He et al.).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def flip_and_crop(x: torch.Tensor, gen: torch.Generator, pad: int | None = None) -> torch.Tensor:
    """Flip each image left-right with probability 1/2, then crop it at a random offset
    from the image zero-padded by ``pad`` pixels on every side (default: an eighth of the
    height, 4 pixels for 32x32 images)."""
    if x.ndim != 4:
        return x
    b, _, h, w = x.shape
    pad = max(1, h // 8) if pad is None else pad
    flip = torch.rand(b, generator=gen) < 0.5
    x = torch.where(flip.view(b, 1, 1, 1).to(x.device), x.flip(3), x)
    if pad <= 0:
        return x
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen).tolist()
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen).tolist()
    return torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])
