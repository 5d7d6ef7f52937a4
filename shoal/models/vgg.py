"""VGG-11 with batch normalization (Simonyan & Zisserman 2015), CIFAR-style classifier.

A pooling layer is skipped once the feature map is down to 1x1, so inputs smaller than
32x32 work.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.models.small import _image

VGG11 = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, cfg: list = VGG11) -> None:
        super().__init__()
        c, h, w = _image(input_shape, "vgg11")
        layers: list[nn.Module] = []
        for item in cfg:
            if item == "M":
                if min(h, w) >= 2:
                    layers.append(nn.MaxPool2d(2))
                    h, w = h // 2, w // 2
                continue
            layers += [nn.Conv2d(c, item, 3, padding=1), nn.BatchNorm2d(item), nn.ReLU(inplace=True)]
            c = item
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
