"""Models for capture's edge cases (in-place writes across units, a batch size fixed by export):
entry points `tests.capture_models:NAME`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


class Writers(nn.Module):
    """Every kind of in-place write, most of them right at a unit boundary:

    - an in-place activation module that is a unit of its own, right after a BatchNorm unit;
    - `s.add_(u)`: a free operation in unit `b` writing into a tensor made in unit `a`, which later
      units read after the write (the written value must cross the cuts);
    - a write into a view (`v[:, :4].mul_`), `nn.Dropout(p=0, inplace=True)` as a unit of its own,
      `w += s`, `torch.relu_`, `F.relu(inplace=True)`;
    - with `input_write`, `y.mul_(0.5)` writes into a model input that a later unit reads.
    `export=True` adds a branch on a shape, so torch.fx fails and torch.export captures it (ATen
    in-place operators instead of Python ones)."""

    def __init__(self, dim: int, export: bool, input_write: bool):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.act = nn.SiLU(inplace=True)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.c = nn.Linear(dim, dim)
        self.d = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p=0.0, inplace=True)
        self.out = nn.Linear(dim, dim)
        self.export, self.input_write = export, input_write

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm(self.inp(x)))
        if self.export and x.shape[-1] % 2 == 0:  # a Python branch on a shape: fx cannot trace it
            h = h * 1.0
        s = self.a(h)
        u = self.b(torch.tanh(s))  # tanh keeps its output for backward, not s: writing s is allowed
        s.add_(u)
        v = self.c(s)
        v[:, :4].mul_(0.5)
        if self.input_write:
            y.mul_(0.5)
        w = self.drop(self.d(v))
        w += s
        torch.relu_(w)
        return F.relu(self.out(w), inplace=True) + y


def writers(dim: int = 8, export: bool = False, input_write: bool = False) -> ModelSpec:
    module = Writers(dim, export, input_write)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(31 * step + 1)
        x, y, target = (torch.randn(batch_size, dim, generator=g) for _ in range(3))
        return (x, y), target

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class Counter(nn.Module):
    """A buffer written in one unit (a count of forwards) and read in another: every stage holds
    its own copy, so the two units must be one."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.seen.add_(1)
        return self.c(self.b(h)) * (1 + 0 * self.seen)


def counter() -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, 4, generator=g),), torch.randn(batch_size, 4, generator=g)

    return ModelSpec(module=Counter(), batch=batch, loss=F.mse_loss)


def scale_in_place(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(2)


torch.fx.wrap("scale_in_place")  # a leaf function to torch.fx: capture cannot see the write inside


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_in_place(x)


class HiddenWrite(nn.Module):
    """A unit whose first operation writes into its input where capture cannot see it: it runs in
    the whole model and fails as a stage of its own (its input is a received leaf)."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.a, self.scale, self.b = nn.Linear(dim, dim), Scale(), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.scale(self.a(x)))


def hidden_write() -> ModelSpec:
    spec = counter()
    return ModelSpec(module=HiddenWrite(), batch=spec.batch, loss=spec.loss)


class PerSample(nn.Module):
    """A Python loop over the samples (as LLaVA turns its image features into a list): torch.fx
    cannot iterate a traced tensor, and torch.export fixes the graph to the example's batch size."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.stack([row * (k + 1) for k, row in enumerate(h)]))


def per_sample() -> ModelSpec:
    spec = counter()
    return ModelSpec(module=PerSample(), batch=spec.batch, loss=spec.loss)
