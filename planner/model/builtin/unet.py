"""A small U-Net: an encoder of double convolutions and poolings, a bottleneck, and a decoder
that upsamples (transposed convolution) and concatenates the encoder's feature map of the same
resolution, so every skip crosses all the cuts between its encoder and decoder level. Double
convolutions are `nn.Sequential`s of conv, BatchNorm, `nn.ReLU(inplace=True)` (capture looks
through them: each in-place ReLU stays in its BatchNorm's unit, planner/model/inplace.py). The output is
a per-pixel class map; the loss is per-pixel cross-entropy."""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


def double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, depth: int, width: int, classes: int):
        super().__init__()
        widths = [width * 2 ** level for level in range(depth + 1)]
        self.down = nn.ModuleList(double_conv(3 if level == 0 else widths[level - 1], widths[level])
                                  for level in range(depth))
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = double_conv(widths[depth - 1], widths[depth])
        self.upsample = nn.ModuleList(nn.ConvTranspose2d(widths[level + 1], widths[level], 2, stride=2)
                                      for level in reversed(range(depth)))
        self.up = nn.ModuleList(double_conv(2 * widths[level], widths[level]) for level in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips: List[torch.Tensor] = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for upsample, up, skip in zip(self.upsample, self.up, reversed(skips)):
            x = up(torch.cat([upsample(x), skip], dim=1))
        return self.head(x)


def build(depth: int = 2, width: int = 4, image: int = 16, classes: int = 3) -> ModelSpec:
    """`depth` poolings (the image side must be divisible by 2**depth), `width` channels at the top level."""
    if depth < 1 or image % 2 ** depth:
        raise ValueError(f"unet: depth must be >= 1 and image divisible by 2**depth (got depth {depth}, image {image})")
    model = UNet(depth, width, classes)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(7919 * step + 17)
        images = torch.randn(batch_size, 3, image, image, generator=g)
        labels = torch.randint(0, classes, (batch_size, image, image), generator=g)
        return (images,), labels

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    return ModelSpec(module=model, batch=batch, loss=loss)
