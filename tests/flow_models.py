"""Glow-like normalizing flows whose coupling layers save views of one storage in several units, which a
stage starting among them receives apart (planner.cost.received): entry points `tests.flow_models:NAME`.

One step: actnorm (its product saves its input), an invertible 1x1 mixing (a square matrix), and an affine
coupling of a = x[:, :k] and b = x[:, k:], two views of the mixing's output x, in three units: `net_in` reads a
(its Linear saves a), `net_out` saves neither, `affine` scales b (its product saves b). Inside a stage a and b
are one storage, x's, which net_in and affine both save (a gap pair: planner.cost.shared_storage); a stage
starting at net_in or net_out receives them as two messages, two storages.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


class _ActNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.loc = nn.Parameter(0.1 * torch.randn(dim))
        self.log_scale = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor, logdet: torch.Tensor) -> tuple:
        return x * torch.exp(self.log_scale) + self.loc, logdet + self.log_scale.sum()


class _Mix(nn.Module):
    """The invertible 1x1 convolution of a flat input: x W^T, W square (an orthogonal start)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linalg.qr(torch.randn(dim, dim))[0])

    def forward(self, x: torch.Tensor, logdet: torch.Tensor) -> tuple:
        return F.linear(x, self.weight), logdet + torch.linalg.slogdet(self.weight)[1]


class _Net(nn.Module):
    """The coupling's net in one unit (the `one` conditioner): its first Linear saves a."""

    def __init__(self, split: int, hidden: int, out: int):
        super().__init__()
        self.inp, self.out = nn.Linear(split, hidden), nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


class _Affine(nn.Module):
    """y_b = b exp(tanh(s)) + t of the coupling net's (s, t): the product saves b and exp(tanh(s)); with the
    model input x0, y_b times x0's last columns (a view of x0, saved)."""

    def forward(self, b: torch.Tensor, st: torch.Tensor, logdet: torch.Tensor,
                x0: Optional[torch.Tensor] = None) -> tuple:
        s, t = st.chunk(2, dim=1)
        s = torch.tanh(s)
        y = b * torch.exp(s) + t
        if x0 is not None:
            y = y * x0[:, -b.shape[1]:]
        return y, logdet + s.sum(1)


class Flow(nn.Module):
    """`steps` flow steps on `dim` features split at k = `split`. `input_gap`: the last step's affine reads the
    model input x0 again, which the first actnorm saves (one storage two units far apart save: a stage holding
    both holds it once). `conditioner` "one": each coupling's net is one unit, which saves a, the affine unit right
    after it b (neighbours saving one storage, x's, which a stage starting at the net receives apart)."""

    def __init__(self, dim: int, split: int, hidden: int, steps: int, input_gap: bool, conditioner: str):
        super().__init__()
        self.split, self.input_gap, self.one = split, input_gap, conditioner == "one"
        self.norms = nn.ModuleList(_ActNorm(dim) for _ in range(steps))
        self.mixes = nn.ModuleList(_Mix(dim) for _ in range(steps))
        out = 2 * (dim - split)
        if self.one:
            self.nets = nn.ModuleList(_Net(split, hidden, out) for _ in range(steps))
        else:
            self.net_in = nn.ModuleList(nn.Linear(split, hidden) for _ in range(steps))
            self.net_out = nn.ModuleList(nn.Linear(hidden, out) for _ in range(steps))
        self.affine = nn.ModuleList(_Affine() for _ in range(steps))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x, logdet = x0, x0.new_zeros(x0.shape[0])
        last = len(self.norms) - 1
        for i in range(len(self.norms)):
            x, logdet = self.norms[i](x, logdet)
            x, logdet = self.mixes[i](x, logdet)
            a, b = x[:, :self.split], x[:, self.split:]
            if self.one:
                st = self.nets[i](a)
            else:
                st = self.net_out[i](torch.relu(self.net_in[i](a)))  # net_in's Linear saves a; the ReLU its output
            y, logdet = self.affine[i](b, st, logdet, x0 if self.input_gap and i == last else None)
            x = torch.cat([a, y], dim=1)
        # the negative log-likelihood per sample under a standard normal (up to a constant)
        return 0.5 * (x * x).sum(1) - logdet


def glow(dim: int = 6, split: int = 3, hidden: int = 4, steps: int = 2, input_gap: bool = False,
         conditioner: str = "split") -> ModelSpec:
    """A Glow-like flow (`Flow`); its loss is the mean negative log-likelihood (no target)."""
    torch.manual_seed(11)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(17 * step + 1)
        return (torch.randn(batch_size, dim, generator=g),), None

    return ModelSpec(module=Flow(dim, split, hidden, steps, input_gap, conditioner), batch=batch,
                     loss=lambda nll, _: nll.mean())
