"""Small models for runtime tests: entry points `tests.models:NAME`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.spec import ModelSpec


class LongSkip(nn.Module):
    """An encoder output consumed by the last unit (a skip crossing every cut after it), and a
    size computed at the top level and used several units later (a constant crossing cuts)."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.enc = nn.Linear(dim, dim)
        self.mid = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.dec = nn.Linear(2 * dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))  # read through get_attr at the top level

    def forward(self, x, y):
        n = x.size(1)
        e = torch.tanh(self.enc(x))
        h = e
        for layer in self.mid:
            h = torch.relu(layer(h)) + y
        out = self.dec(torch.cat([h, e], dim=1)) * self.scale
        return out.reshape(-1, n)


def long_skip(dim: int = 16, layers: int = 4) -> ModelSpec:
    module = LongSkip(dim, layers)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, dim, generator=g), torch.randn(batch_size, dim, generator=g)), \
            torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


def failing(fail_step: int = 1) -> ModelSpec:
    """An MLP whose loss raises at `fail_step`: only the last rank computes the loss, so one rank fails
    while the others wait on it."""
    from planner.models.mlp import build

    spec = build(layers=2)
    loss_fn = spec.loss
    calls = {"n": 0}

    def loss(output, target):
        import os

        calls["n"] += 1
        if os.environ.get("RANK") and calls["n"] > fail_step * 2:  # only inside the runtime  # two micro-batches per step in the test plan
            raise RuntimeError("injected failure in the loss")
        return loss_fn(output, target)

    return ModelSpec(module=spec.module, batch=spec.batch, loss=loss)
