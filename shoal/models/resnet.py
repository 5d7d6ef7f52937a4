"""Residual networks (He et al. 2016).

* ``resnet20``, ``resnet56``: the CIFAR networks of section 4.2 — three stages of 16, 32, 64
  channels, ``6n+2`` layers, identity shortcuts with zero-padding (option A).
* ``resnet18``, ``resnet50``: the ImageNet networks (basic and bottleneck blocks, 7x7 stem,
  projection shortcuts), as in torchvision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.models.small import _image


def _init(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class _CifarBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride, self.extra = stride, cout - cin

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1 and self.extra == 0:
            return x
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for small images."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, n: int) -> None:
        super().__init__()
        c, _, _ = _image(input_shape, f"resnet{6 * n + 2}")
        self.conv = nn.Conv2d(c, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        cin = 16
        for i, cout in enumerate((16, 32, 64)):
            for j in range(n):
                blocks.append(_CifarBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.down = _projection(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + (self.down(x) if self.down is not None else x))


class _Bottleneck(_Basic):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        nn.Module.__init__(self)
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.down = _projection(cin, cout, stride)


def _projection(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ImageNetResNet(nn.Module):
    """ResNet-18/50 as in the paper's table 1."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, block: type[_Basic],
                 layers: tuple[int, ...], name: str) -> None:
        super().__init__()
        c, _, _ = _image(input_shape, name)
        self.stem = nn.Sequential(
            nn.Conv2d(c, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        stages: list[nn.Module] = []
        cin = 64
        for i, (width, count) in enumerate(zip((64, 128, 256, 512), layers, strict=False)):
            for j in range(count):
                stages.append(block(cin, width, 2 if (i > 0 and j == 0) else 1))
                cin = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet20(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return CifarResNet(input_shape, num_classes, 3)


def resnet56(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return CifarResNet(input_shape, num_classes, 9)


def resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return ImageNetResNet(input_shape, num_classes, _Basic, (2, 2, 2, 2), "resnet18")


def resnet50(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return ImageNetResNet(input_shape, num_classes, _Bottleneck, (3, 4, 6, 3), "resnet50")
