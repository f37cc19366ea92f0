"""Test models whose shapes or saved bytes the data sets: experts routed by value (`nonzero`),
rows gated by a threshold, a CTC loss whose table follows the label lengths."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


class RoutedExperts(nn.Module):
    """A mixture of experts that routes each sample to one expert by index: the tokens an expert gets
    (`x[sel]`, `sel` from `nonzero`) and its output on them have a shape the data sets; their sum,
    written back with `index_add` (out of place), has the input's shape."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = torch.nonzero(route == e).squeeze(-1)
            out = out.index_add(0, sel, expert(x[sel]))
        return x + out


class Routed(nn.Module):
    def __init__(self, dim: int, experts: int, layers: int, export: bool):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.blocks = nn.ModuleList(RoutedExperts(dim, experts) for _ in range(layers))
        self.out = nn.Linear(dim, dim)
        self.export = export

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        if self.export and x.shape[-1] % 2 == 0:  # a Python branch on a shape: fx cannot trace it
            h = h * 1.0
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def routed(dim: int = 8, experts: int = 3, layers: int = 2, export: bool = False) -> ModelSpec:
    """Mixture-of-experts layers with data-sized tokens per expert (RoutedExperts) after a BatchNorm."""
    module = Routed(dim, experts, layers, export)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(17 * step + 3)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class GatedBlock(nn.Module):
    """Rows whose feature `feature` passes a threshold go through a wide block (`nonzero`, `index_add`)."""

    def __init__(self, dim: int, wide: int, feature: int):
        super().__init__()
        self.gate = nn.Linear(dim, dim)
        self.wide = nn.Sequential(nn.Linear(dim, wide), nn.Tanh(), nn.Linear(wide, dim))
        self.feature = feature

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sel = (self.gate(h)[:, self.feature] > 0.0).nonzero().squeeze(1)  # in the gate's unit, with the wide part
        return h.index_add(0, sel, self.wide(h[sel]))


class GatedRows(nn.Module):
    """Gated blocks: how many rows each saves for backward, and so a unit's activation bytes, the data
    sets. With `apart`, block k gates on feature k: the blocks' bytes peak on different batches."""

    def __init__(self, dim: int, layers: int, wide: int, apart: bool):
        super().__init__()
        self.inp, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(GatedBlock(dim, wide, k if apart else 0) for k in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def gated_rows(dim: int = 8, layers: int = 3, wide: int = 256, apart: bool = False) -> ModelSpec:
    torch.manual_seed(4)
    module = GatedRows(dim, layers, wide, apart)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


def _ctc(log_probs: torch.Tensor, target) -> torch.Tensor:
    labels, lengths = target
    frames = torch.full((log_probs.shape[0],), log_probs.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs.transpose(0, 1), labels, frames, lengths)


def ctc_labels(dim: int = 8, frames: int = 10, classes: int = 6) -> ModelSpec:
    """A CTC loss, whose saved alignment table is as long as the micro-batch's longest label sequence:
    the bytes the last unit holds follow the target's values (label lengths 1-4 by sample and step)."""
    module = nn.Sequential(nn.Linear(5, dim), nn.Tanh(), nn.Linear(dim, classes), nn.LogSoftmax(-1))

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        labels = torch.randint(1, classes, (batch_size, 4), generator=g)
        lengths = 1 + (torch.arange(batch_size) + step) % 4
        return (torch.randn(batch_size, frames, 5, generator=g),), (labels, lengths)

    return ModelSpec(module=module, batch=batch, loss=_ctc)
