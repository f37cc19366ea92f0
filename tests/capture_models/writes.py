"""Test models that write in place or keep state their forward writes: in-place writes across
units, buffers and aliased statistics, spectral norm's vectors, an EMA, attributes set in forward."""
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


class AliasedState(nn.Module):
    """State that is one tensor under two names: two BatchNorms given one set of running statistics
    (`bn2.running_mean = bn1.running_mean`), and a weight tied by attribute (`tail.weight =
    clip.weight`), clipped in place through `.data` units before the tail reads it. Each stage holds
    its own copy of what it reads: the units writing and reading one tensor must be one."""

    def __init__(self, dim: int):
        super().__init__()
        self.f1, self.bn1, self.mid = nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.Linear(dim, dim)
        self.f2, self.bn2, self.sep = nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.Linear(dim, dim)
        self.clip, self.gap, self.tail = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(self.bn2, name, getattr(self.bn1, name))
        self.tail.weight = self.clip.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.bn1(self.f1(x))))
        h = torch.tanh(self.sep(self.bn2(self.f2(h))))
        self.clip.weight.data.clamp_(-0.2, 0.2)
        h = torch.tanh(self.gap(torch.tanh(self.clip(h))))
        return self.tail(h)


def aliased_state(dim: int = 8) -> ModelSpec:
    torch.manual_seed(3)
    return to_random_targets(AliasedState(dim), dim, 7, 2)


class SpectralChain(nn.Module):
    """Layers under spectral_norm: each forward reads and updates its power-iteration vectors."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(torch.nn.utils.parametrizations.spectral_norm(nn.Linear(dim, dim))
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def to_random_targets(module: nn.Module, dim: int, every: int, offset: int) -> ModelSpec:
    """`module` on batches of `dim` features trained by MSE to random targets, step s drawn from seed
    every * s + offset."""
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(every * step + offset)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


def spectral_chain(dim: int = 8, layers: int = 4) -> ModelSpec:
    torch.manual_seed(3)
    return to_random_targets(SpectralChain(dim, layers), dim, 7, 2)


class EmaChain(nn.Module):
    """Linear layers, the middle one keeping an EMA of its input and a step counter in buffers, written in
    place under no_grad and read by the forward (no norm layer: torch.export wraps the region)."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == len(self.layers) // 2:
                with torch.no_grad():
                    self.mean.mul_(0.9).add_(0.1 * x.mean(0))
                    self.steps += 1
                x = x - self.mean
        return x


def ema_chain(dim: int = 8, layers: int = 4) -> ModelSpec:
    torch.manual_seed(4)
    return to_random_targets(EmaChain(dim, layers), dim, 5, 1)


class _Gate(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        self.aux = (h ** 2).mean()  # a balancing term kept on the module, as some MoE code does
        return h


class ForwardState(nn.Module):
    """Forward sets attributes (`gate.aux`, `last`) that torch.fx refuses and torch.export's graph
    does not carry."""

    def __init__(self, dim: int):
        super().__init__()
        self.gate, self.b, self.c = _Gate(dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.b.register_buffer("scale", torch.tensor(2.0))
        self.c.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(self.gate(x)) * self.b.scale)
        self.last = h.detach()  # kept for inspection; no loss reads it
        return self.c(h) * self.c.scale


def forward_state(dim: int = 4, loss_reads: bool = False, penalty: str = "", constant: str = "") -> ModelSpec:
    """With `loss_reads` the loss adds the gate's `aux`, with `penalty` one on that layer's weight
    ("b": a pipeline's last stage can compute neither; "c": the last unit's, it can); `constant`
    ("b.scale", "c.scale": a buffer; "b.bias": that bias frozen) scales the loss by its mean."""
    module = ForwardState(dim)
    module.b.bias.requires_grad_(constant != "b.bias")

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = F.mse_loss(output, target) + (0.1 * module.gate.aux if loss_reads else 0.0) + \
            (0.05 * getattr(module, penalty).weight.pow(2).sum() if penalty else 0.0)
        return value * module.get_parameter(constant).mean() if constant == "b.bias" else \
            value * module.get_buffer(constant) if constant else value

    return ModelSpec(module=module, batch=batch, loss=loss)
