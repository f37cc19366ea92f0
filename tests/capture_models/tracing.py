"""Test models that torch.fx and torch.export capture unlike eager execution (a loop over the
samples, casts made constants, custom autograd Functions, hooks, modes, optional and star
arguments, a path taken only while exporting), and a loss capture refuses."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec

from tests.capture_models.writes import counter


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


class _Norm(nn.Module):
    """Llama's RMSNorm: computes in fp32, returns its input's dtype (`h.to(dtype)`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.to(torch.float32)  # nothing in fp32: the fp32 graph then reads it where `h` was meant
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class _Block(nn.Module):
    """A residual block; with `add_apart` its residual sum is done by the next unit."""

    def __init__(self, dim: int, add_apart: bool):
        super().__init__()
        self.norm, self.lin, self.add_apart = _Norm(dim), nn.Linear(dim, dim), add_apart

    def forward(self, h: torch.Tensor):
        residual = h
        out = self.lin(self.norm(h))
        return (residual, out) if self.add_apart else residual + out


class _Sum(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


class _Head(nn.Module):
    """ViT's cast of its input to the weight's dtype, and a mask filled with the dtype's least value."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.lin = nn.Linear(dim, vocab)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lin(h.to(self.lin.weight.dtype))
        # a node naming a device (placed on the run's: runtime.stage.build_rank) and a dtype
        floor = torch.full((1,), torch.finfo(logits.dtype).min / 2, dtype=logits.dtype, device=ids.device)
        return torch.where(ids.unsqueeze(-1) == 0, floor, logits)


class CastsLikeHF(nn.Module):
    """The casts Hugging Face models make to a tensor's dtype, which torch.export records as
    constants (planner.model.casts): an embedding table (bf16 under bf16-mixed, so the residual stream is
    too), norms computing in fp32 and casting back, a cast to a weight's dtype, a mask value from
    `torch.finfo`. A branch on a shape makes torch.fx fail, so torch.export captures it. With
    `add_apart` a residual sum is a unit of its own (a cut between them changes what crosses it
    under bf16)."""

    def __init__(self, vocab: int, dim: int, layers: int, add_apart: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, add_apart and k == 0) for k in range(layers))
        self.sum = _Sum() if add_apart else None
        self.head = _Head(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if ids.shape[-1] > 1:  # a Python branch on a shape: fx cannot trace it
            h = h * 1.0
        for k, block in enumerate(self.blocks):
            h = block(h)
            if k == 0 and self.sum is not None:
                h = self.sum(h)
        return self.head(h, ids)


def casts_like_hf(vocab: int = 16, dim: int = 8, layers: int = 3, seq: int = 4, add_apart: bool = False) -> ModelSpec:
    module = CastsLikeHF(vocab, dim, layers, add_apart)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
        return (ids,), torch.randint(1, vocab, (batch_size, seq), generator=g)

    def loss(logits, target):
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    return ModelSpec(module=module, batch=batch, loss=loss)


class Reversal(torch.autograd.Function):
    """A gradient-reversal layer: forward is the identity, backward negates and scales."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return -ctx.alpha * grad, None


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class WhatFxDrops(nn.Module):
    """What a traced graph computes differently unless capture sees it: a custom autograd Function
    (its backward), a block with a full backward hook (fx traces through a module's forward, past its
    hooks), a scripted module (fx would call its compiled forward, whose parameters no stage holds),
    one BatchNorm called at two places (its statistics), a weight clipped in place through `.data`
    before the unit using it; with `tied`, an embedding renormalised to `max_norm` (in place)
    whose weight the output layer reads. With `region`, a `set_grad_enabled(False)` and an autocast
    region instead (fx does not record modes: torch.export captures the model)."""

    def __init__(self, dim: int, region: bool, tied: bool):
        super().__init__()
        self.emb = nn.Embedding(16, dim, max_norm=1.0 if tied else None)
        self.norm = nn.BatchNorm1d(dim)
        self.first, self.hooked, self.last = Block(dim), Block(dim), Block(dim)
        self.hooked.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))
        self.clip = nn.Linear(dim, dim)
        self.scripted = torch.jit.script(nn.Linear(dim, dim))
        self.out = nn.Linear(dim, dim)
        self.region, self.tied = region, tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(tokens).sum(1))
        if self.region:
            with torch.set_grad_enabled(False):
                scale = torch.sigmoid(self.first(h))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.clip(h * scale).float()
            return self.out(self.last(h))
        h = Reversal.apply(self.norm(self.first(h)), 0.5)
        h = self.hooked(h)
        self.clip.weight.data.clamp_(-0.2, 0.2)
        h = self.clip(self.last(self.scripted(h)))
        return self.out(h) + (F.linear(h, self.emb.weight).sum(-1, keepdim=True) if self.tied else 0.0)


def what_fx_drops(dim: int = 8, region: bool = False, tied: bool = False) -> ModelSpec:
    torch.manual_seed(5)
    module = WhatFxDrops(dim, region, tied)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(13 * step + 1)
        return (torch.randint(0, 16, (batch_size, 3), generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class OptionalArguments(nn.Module):
    """forward(x, bias=None, mask=None) with branches on None: the batches give a mask, no bias."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, bias=None, mask=None) -> torch.Tensor:
        h = self.a(x)
        if bias is not None:
            h = h + bias
        if mask is not None:
            h = h * mask
        return self.b(h)


def optional_arguments(dim: int = 4, bias_from: int = -1) -> ModelSpec:
    """`bias_from`: the first step whose batch gives a bias too (-1: none)."""
    module = OptionalArguments(dim)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        x, mask, target = torch.randn(batch_size, dim, generator=g), torch.rand(batch_size, dim, generator=g), \
            torch.randn(batch_size, dim, generator=g)
        extra = {"bias": torch.ones(batch_size, dim)} if 0 <= bias_from <= step else {}
        return (x, {"mask": mask, **extra}), target

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class StarArgs(nn.Module):
    """`forward(self, *args, **kwargs)`: fx would make the batch's values one placeholder."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, *args, **kwargs):
        x, y = args[0], args[1]  # fx traces this (indexing one placeholder), wrongly
        return self.b(torch.tanh(self.a(x)) * kwargs.get("scale", 1.0)) + y


def star_args(dim: int = 4) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        x, y, target = (torch.randn(batch_size, dim, generator=g) for _ in range(3))
        return (x, y), target

    return ModelSpec(module=StarArgs(dim), batch=batch, loss=F.mse_loss)


class CustomFunctions(nn.Module):
    """Custom Functions fx cannot take (a branch on a shape): a gradient reversal returning a view of its
    input, and one with two outputs, a keyword argument and a tensor it gives no gradient to."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        if x.shape[-1] % 2 == 0:
            x = x * 1.0
        h = Reversal.apply(self.a(x), 0.5)
        low, high = StraightThroughSplit.apply(self.b(h), torch.ones(x.shape[-1], device=x.device), cut=0.1)
        return self.c(low * 2.0 + high)


class StraightThroughSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cut):
        return (x * weight).clamp(max=cut), (x * weight).clamp(min=cut)

    @staticmethod
    def backward(ctx, low, high):  # not autograd's derivative of the clamps
        return low + 3.0 * high, None, None


def custom_functions(dim: int = 4) -> ModelSpec:
    torch.manual_seed(3)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=CustomFunctions(dim), batch=batch, loss=F.mse_loss)


class ExportsOtherwise(nn.Module):
    """Takes another path while exported (as transformers' mask code does under tracing); a BatchNorm
    whose statistics the check must put back."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.norm = nn.Linear(dim, dim), nn.BatchNorm1d(dim)

    def forward(self, x):
        if x.shape[-1] % 2 == 0:  # fx cannot trace it: torch.export
            x = x * 1.0
        h = self.norm(self.a(x))
        return h * 2.0 if torch.compiler.is_exporting() else h


def exports_otherwise(dim: int = 4) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=ExportsOtherwise(dim), batch=batch, loss=F.mse_loss)


def bad_loss(kind: str = "mean", dim: int = 8) -> ModelSpec:
    """A small classifier whose loss returns what no backward starts from: `vector` (reduction='none'),
    `number` (a Python float), `no_grad` (accuracy: through argmax and a comparison); `mean` is right."""
    module = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 3))

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(7 * step + 2)
        return (torch.randn(batch_size, dim, generator=g),), torch.randint(0, 3, (batch_size,), generator=g)

    def loss(out: torch.Tensor, target: torch.Tensor):
        if kind == "vector":
            return F.cross_entropy(out, target, reduction="none")
        if kind == "number":
            return F.cross_entropy(out, target).item()
        if kind == "no_grad":
            return (out.argmax(-1) == target).float().mean()
        return F.cross_entropy(out, target)

    return ModelSpec(module=module, batch=batch, loss=loss)
