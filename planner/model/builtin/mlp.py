"""A residual MLP: an input projection, N residual blocks, an output projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


class MLPBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, inputs: int, dim: int, layers: int, outputs: int):
        super().__init__()
        self.inp = nn.Linear(inputs, dim)
        self.blocks = nn.Sequential(*(MLPBlock(dim) for _ in range(layers)))
        self.out = nn.Linear(dim, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def build(inputs: int = 32, dim: int = 64, layers: int = 4, outputs: int = 8) -> ModelSpec:
    model = MLP(inputs, dim, layers, outputs)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(104729 * step + 11)
        x = torch.randn(batch_size, inputs, generator=g)
        y = torch.randn(batch_size, outputs, generator=g)
        return (x,), y

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    return ModelSpec(module=model, batch=batch, loss=loss)
