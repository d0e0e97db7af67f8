"""DenseNet 121/169/201 (torchvision's layout: growth 32, bottleneck width 4x, compression 0.5).

A dense block is made a chain by letting each dense layer output ``cat([input, new features])``:
the same parameters and the same arithmetic as torchvision (whose layers each concatenate all
earlier features before their first batch norm), one stage per dense layer. Chain stages: the
stem's conv, norm, ReLU and pool, each dense layer, each transition, the final norm, then ReLU +
pooling + classifier (DenseNet-121: 7,978,856 parameters, as torchvision).
"""
from __future__ import annotations

from typing import List, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import ZooModel, check_positive, on_device


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int, bn_size: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.conv1(self.relu1(self.norm1(x)))
        new = self.conv2(self.relu2(self.norm2(new)))
        return torch.cat([x, new], 1)


class Transition(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)
        self.pool = nn.AvgPool2d(2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(self.relu(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self, cin: int, num_classes: int):
        super().__init__()
        self.classifier = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(F.adaptive_avg_pool2d(F.relu(x), 1), 1)
        return self.classifier(x)


def densenet(depth: int, batch: int = 1, image: int = 224, num_classes: int = 1000,
             device: Union[str, torch.device, None] = None) -> ZooModel:
    layouts = {121: (6, 12, 24, 16), 169: (6, 12, 32, 32), 201: (6, 12, 48, 32)}
    if depth not in layouts:
        raise ValueError(f"depth: expected one of {sorted(layouts)}, got {depth!r}")
    check_positive(batch=batch, image=image, num_classes=num_classes)
    growth, bn_size = 32, 4
    with on_device(device):
        blocks: List[nn.Module] = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
                                   nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)]
        c = 64
        for i, n in enumerate(layouts[depth]):
            for _ in range(n):
                blocks.append(DenseLayer(c, growth, bn_size))
                c += growth
            if i != len(layouts[depth]) - 1:
                blocks.append(Transition(c, c // 2))
                c //= 2
        blocks += [nn.BatchNorm2d(c), Classifier(c, num_classes)]
        for b in blocks:  # torchvision's initialization (a no-op on the meta device)
            for m in b.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight)
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
                elif isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)
    return ZooModel(blocks, (batch, 3, image, image), name=f"densenet{depth}")


def densenet121(**kw) -> ZooModel:
    return densenet(121, **kw)


def densenet201(**kw) -> ZooModel:
    return densenet(201, **kw)
