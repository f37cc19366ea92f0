"""A small MobileNetV3-style network, written the way torchvision writes it: inverted residual
blocks (1x1 expansion, depthwise 3x3, squeeze-and-excitation, 1x1 projection), BatchNorm, in-place
activations (`nn.Hardswish(inplace=True)`, `nn.ReLU(inplace=True)`), `result += input` residual
adds, and convolution-norm-activation triples as `nn.Sequential`s, so that capture looks through
them and an in-place activation follows its BatchNorm across a unit boundary (capture keeps the
two in one unit, planner/model/inplace.py). The classifier ends with `nn.Dropout(p=0, inplace=True)`:
a write with no effect on the values (random dropout would make a pipeline's masks differ from one
process's)."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from planner.model.spec import ModelSpec, image_classification


class ConvNormAct(nn.Sequential):
    """conv, BatchNorm, in-place activation (torchvision's Conv2dNormActivation)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: type = nn.Hardswish):
        layers: List[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                                   nn.BatchNorm2d(cout)]
        if act is not None:
            layers.append(act(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.scale = nn.Hardsigmoid(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scale(self.fc2(self.relu(self.fc1(self.avgpool(x)))))
        return s * x


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, expanded: int, cout: int, stride: int, squeeze: bool, act: type):
        super().__init__()
        layers: List[nn.Module] = []
        if expanded != cin:
            layers.append(ConvNormAct(cin, expanded, 1, act=act))
        layers.append(ConvNormAct(expanded, expanded, 3, stride, groups=expanded, act=act))
        if squeeze:
            layers.append(SqueezeExcitation(expanded, max(expanded // 4, 2)))
        layers.append(ConvNormAct(expanded, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.block(x)
        if self.residual:
            result += x
        return result


# (expanded, out, stride, squeeze-excitation, activation) per block, MobileNetV3-small's pattern
_BLOCKS: Tuple[Tuple[int, int, int, bool, type], ...] = (
    (16, 16, 2, True, nn.ReLU), (36, 12, 2, False, nn.ReLU), (44, 12, 1, False, nn.ReLU),
    (48, 20, 2, True, nn.Hardswish), (60, 20, 1, True, nn.Hardswish), (60, 24, 1, True, nn.Hardswish),
)


class MobileNet(nn.Module):
    def __init__(self, blocks: int, width: float, classes: int):
        super().__init__()
        scale = lambda c: max(int(c * width) // 4 * 4, 4)  # noqa: E731
        channels = scale(16)
        features: List[nn.Module] = [ConvNormAct(3, channels, 3, 2)]
        for expanded, out, stride, squeeze, act in _BLOCKS[:blocks]:
            features.append(InvertedResidual(channels, scale(expanded), scale(out), stride, squeeze, act))
            channels = scale(out)
        features.append(ConvNormAct(channels, 6 * channels, 1))
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(6 * channels, scale(64)), nn.Hardswish(inplace=True),
                                        nn.Dropout(p=0.0, inplace=True), nn.Linear(scale(64), classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.classifier(x)


def build(blocks: int = 6, width: float = 0.5, image: int = 32, classes: int = 10) -> ModelSpec:
    """`blocks` (1-6) inverted residual blocks, channel `width` multiplier, square `image` size
    (at least 16: BatchNorm after the last stride needs more than one value per channel)."""
    if not 1 <= blocks <= len(_BLOCKS):
        raise ValueError(f"mobilenet: blocks must be 1..{len(_BLOCKS)} (got {blocks})")
    return image_classification(MobileNet(blocks, width, classes), image, classes, seed=11)
