"""Small classic networks: a multi-layer perceptron, LeNet-5 and a CIFAR-size AlexNet."""

from __future__ import annotations

import math

import torch
from torch import nn

from shoal.errors import ShoalError


def _image(input_shape: tuple[int, ...], model: str, min_side: int = 1) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ShoalError(f"model {model} needs image input (C, H, W); the dataset's samples "
                         f"have shape {tuple(input_shape)}")
    c, h, w = input_shape
    if min(h, w) < min_side:
        raise ShoalError(f"model {model} needs images of at least {min_side}x{min_side}, "
                         f"got {h}x{w}")
    return c, h, w


class MLP(nn.Module):
    """Flatten, then ``depth`` hidden ReLU layers of ``width`` units."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 256,
                 depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        features = math.prod(input_shape)
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU(inplace=True)]
            features = width
        layers.append(nn.Linear(features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LeNet5(nn.Module):
    """LeCun et al. 1998 with ReLU and max-pooling; both convolutions padded by 2 so that
    inputs as small as 4x4 (e.g. 8x8 digits) keep a spatial extent."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = _image(input_shape, "lenet5", min_side=4)
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        flat = 16 * (h // 4) * (w // 4)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, 120), nn.ReLU(inplace=True),
            nn.Linear(120, 84), nn.ReLU(inplace=True), nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class AlexNet(nn.Module):
    """The CIFAR-size AlexNet (five convolutions, three pools, two dropout FC layers);
    pooling is padded so that small inputs work too."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, _, _ = _image(input_shape, "alexnet")
        self.features = nn.Sequential(
            nn.Conv2d(c, 64, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
            nn.AdaptiveAvgPool2d((4, 4)),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.5), nn.Linear(256 * 16, 1024), nn.ReLU(inplace=True),
            nn.Dropout(0.5), nn.Linear(1024, 1024), nn.ReLU(inplace=True),
            nn.Linear(1024, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
