"""ResNet 18/34/50/101/152 (torchvision's layout, v1.5: stride on the 3x3 conv) and the
pre-activation ResNet-1001 of He et al., "Identity mappings in deep residual networks" (seed
002's [15]): 3 stages of 111 pre-activation bottlenecks, widths 16/32/64 (x4), which gives a
chain of 338 stages + the loss (seed 002: "a chain of length 339").

Chain stages: the stem's conv, batch norm, ReLU and max pool are separate stages (as a
``nn.Sequential`` of torchvision's modules gives them), one stage per residual block, then
global pooling + flatten and the classifier. Parameter shapes and counts equal torchvision's
(ResNet-50: 25,557,032 parameters).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Type, Union

import torch
import torch.nn as nn

from .common import Flatten, ZooModel, check_positive, on_device


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * 4)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class PreActBottleneck(nn.Module):
    """BN-ReLU-conv ordering; the projection shortcut reads the pre-activated input."""
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = conv1x1(cin, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(x))
        shortcut = x if self.downsample is None else self.downsample(out)
        out = self.conv1(out)
        out = self.conv2(self.relu(self.bn2(out)))
        out = self.conv3(self.relu(self.bn3(out)))
        return out + shortcut


Block = Union[Type[BasicBlock], Type[Bottleneck], Type[PreActBottleneck]]


def _stage(block: Block, cin: int, planes: int, count: int, stride: int, preact: bool) -> List[nn.Module]:
    downsample = None
    if stride != 1 or cin != planes * block.expansion:
        conv = conv1x1(cin, planes * block.expansion, stride)
        downsample = conv if preact else nn.Sequential(conv, nn.BatchNorm2d(planes * block.expansion))
    out = [block(cin, planes, stride, downsample)]
    out += [block(planes * block.expansion, planes) for _ in range(count - 1)]
    return out


def _init(blocks: Sequence[nn.Module]) -> None:
    # torchvision's initialization (a no-op on the meta device)
    for b in blocks:
        for m in b.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


def resnet(depth: int, batch: int = 1, image: int = 224, num_classes: int = 1000,
           device: Union[str, torch.device, None] = None) -> ZooModel:
    """ResNet of the given depth (18, 34, 50, 101, 152, 200 or 1001) for ``batch`` RGB images of
    ``image`` x ``image`` pixels, as a list of blocks built on ``device`` (``"meta"``: free)."""
    layouts = {18: (BasicBlock, (2, 2, 2, 2)), 34: (BasicBlock, (3, 4, 6, 3)),
               50: (Bottleneck, (3, 4, 6, 3)), 101: (Bottleneck, (3, 4, 23, 3)),
               152: (Bottleneck, (3, 8, 36, 3)), 200: (Bottleneck, (3, 24, 36, 3))}
    check_positive(batch=batch, image=image, num_classes=num_classes)
    if depth != 1001 and depth not in layouts:
        raise ValueError(f"depth: expected one of {sorted(layouts) + [1001]}, got {depth!r}")
    with on_device(device):
        if depth == 1001:
            blocks: List[nn.Module] = [conv3x3(3, 16)]
            cin = 16
            for planes, stride in ((16, 1), (32, 2), (64, 2)):
                blocks += _stage(PreActBottleneck, cin, planes, 111, stride, preact=True)
                cin = planes * 4
            blocks += [nn.BatchNorm2d(cin), nn.ReLU(), Flatten(), nn.Linear(cin, num_classes)]
        else:
            block, counts = layouts[depth]
            blocks = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                      nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)]
            cin = 64
            for i, (planes, count) in enumerate(zip((64, 128, 256, 512), counts)):
                blocks += _stage(block, cin, planes, count, 1 if i == 0 else 2, preact=False)
                cin = planes * block.expansion
            blocks += [Flatten(), nn.Linear(cin, num_classes)]
        _init(blocks)
    return ZooModel(blocks, (batch, 3, image, image), name=f"resnet{depth}")


def resnet18(**kw) -> ZooModel:
    return resnet(18, **kw)


def resnet34(**kw) -> ZooModel:
    return resnet(34, **kw)


def resnet50(**kw) -> ZooModel:
    return resnet(50, **kw)


def resnet101(**kw) -> ZooModel:
    return resnet(101, **kw)


def resnet152(**kw) -> ZooModel:
    return resnet(152, **kw)


def resnet1001(**kw) -> ZooModel:
    return resnet(1001, **kw)
