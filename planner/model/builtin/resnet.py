"""A small residual convolutional network: a stem, residual blocks (skip connections inside
the graph, some with a strided projection shortcut), global pooling and a classifier.

`inplace=True` writes it the way torchvision's ResNet is written: a shared
`nn.ReLU(inplace=True)` per block, `out += identity`, and the stem's activation an in-place
module of its own (a unit boundary right before an in-place write: capture keeps the two in one
unit, planner/model/inplace.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec, image_classification


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, batchnorm: bool, inplace: bool):
        super().__init__()
        norm = (lambda c: nn.BatchNorm2d(c)) if batchnorm else (lambda c: nn.GroupNorm(4, c))
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = norm(cout)
        self.shortcut = (nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
                         if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU(inplace=True) if inplace else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.relu is not None:  # torchvision's BasicBlock
            out = self.relu(self.norm1(self.conv1(x)))
            out = self.norm2(self.conv2(out))
            out += self.shortcut(x)
            return self.relu(out)
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, blocks: int, classes: int, batchnorm: bool, inplace: bool = False):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.stem_act = nn.ReLU(inplace=True) if inplace else None
        layers = []
        channels = width
        for i in range(blocks):
            stride = 2 if i in (blocks // 3, 2 * blocks // 3) and i > 0 else 1
            out = channels * stride
            layers.append(ResidualBlock(channels, out, stride, batchnorm, inplace))
            channels = out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem_act(self.stem(x)) if self.stem_act is not None else F.relu(self.stem(x))
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build(width: int = 8, blocks: int = 4, image: int = 16, classes: int = 10, batchnorm: bool = False,
          inplace: bool = False) -> ModelSpec:
    """GroupNorm by default: per-sample normalisation, so micro-batching does not change the maths.
    `batchnorm=True` uses BatchNorm2d (running statistics are buffers, updated micro-batch by micro-batch).
    `inplace=True`: in-place activations and residual adds, as torchvision writes them."""
    return image_classification(ResNet(width, blocks, classes, batchnorm, inplace), image, classes, seed=3)
