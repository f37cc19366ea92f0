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
    module = AliasedState(dim)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(7 * step + 2)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


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


def _to_random_targets(module: nn.Module, dim: int, every: int, offset: int) -> ModelSpec:
    """`module` on batches of `dim` features trained by MSE to random targets, step s drawn from seed
    every * s + offset."""
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(every * step + offset)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


def spectral_chain(dim: int = 8, layers: int = 4) -> ModelSpec:
    torch.manual_seed(3)
    return _to_random_targets(SpectralChain(dim, layers), dim, 7, 2)


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
    return _to_random_targets(EmaChain(dim, layers), dim, 5, 1)


class AliasCross(nn.Module):
    """`h` and an alias of it (`kind`: detach, or a view of all of it) both read after unit `a`: a cut there
    carries both, as two messages, two storages."""

    def __init__(self, dim: int, kind: str):
        super().__init__()
        self.a, self.b, self.c, self.head = (nn.Linear(dim, dim) for _ in range(4))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        alias = h.detach() if self.kind == "detach" else h.view(h.shape[0], -1)[:, :]
        return self.head(self.b(alias) + self.c(h))


def alias_cross(dim: int = 8, kind: str = "detach") -> ModelSpec:
    torch.manual_seed(6)
    return _to_random_targets(AliasCross(dim, kind), dim, 3, 5)


class SharedTable(nn.Module):
    """Token ids, an embedding, two layers that both scale by one table computed from the input's shape alone
    (made again where read, as rotary tables are: planner.model.recomputable) and so both save it, a head."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.a, self.b, self.head = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(ids.shape[1], dtype=torch.float32, device=ids.device)
        table = torch.sin(steps[:, None] * torch.arange(1, self.a.in_features + 1, device=ids.device) * 0.1)
        h = torch.tanh(self.a(self.emb(ids))) * table
        h = torch.tanh(self.b(h)) * table
        return self.head(h)


def shared_table(vocab: int = 32, dim: int = 8, seq: int = 8) -> ModelSpec:
    torch.manual_seed(7)
    module = SharedTable(vocab, dim)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(11 * step + 3)
        return (torch.randint(0, vocab, (batch_size, seq), generator=g),), torch.randn(batch_size, seq, dim,
                                                                                        generator=g)

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


class StarArgs(nn.Module):
    """`forward(self, *args, **kwargs)`: fx would make the batch's values one placeholder."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, *args, **kwargs):
        x, y = args[0], args[1]  # fx traces this (indexing one placeholder), wrongly
        return self.b(torch.tanh(self.a(x)) * kwargs.get("scale", 1.0)) + y


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


def star_args(dim: int = 4) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        x, y, target = (torch.randn(batch_size, dim, generator=g) for _ in range(3))
        return (x, y), target

    return ModelSpec(module=StarArgs(dim), batch=batch, loss=F.mse_loss)


class GatedLayers(nn.Module):
    """A gate made from a parameter by a unit of its own, read by every layer: `h + gate * tanh(W h)`. A
    stage holding the gate's unit computes it from its parameters (no gradient from the stage's inputs)."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.inp, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.gate = nn.Linear(1, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gate = torch.sigmoid(self.gate(torch.ones(1, 1)))
        for layer in self.layers:
            h = h + gate * torch.tanh(layer(h))
        return self.out(h)


def gated_layers(dim: int = 16, layers: int = 4) -> ModelSpec:
    module = GatedLayers(dim, layers)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(7 * step + 2)
        return (torch.randn(batch_size, 8, dim, generator=g),), torch.randn(batch_size, 8, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class _Modulated(nn.Module):
    """A block modulated by a conditioning vector: its `mod` unit makes (shift, scale) in one chunk, which
    its (frozen) `norm` unit applies (the parts cross the cut through a tuple node), then an MLP of units."""

    def __init__(self, dim: int):
        super().__init__()
        self.mod = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.mod(F.silu(c)).unsqueeze(1).chunk(2, dim=-1)
        return h + self.mlp(self.norm(h) * (1 + scale) + shift)


class Conditioned(nn.Module):
    """DiT-like: a label embedding (a model input that needs no gradient) read by every block's modulation."""

    def __init__(self, dim: int, blocks: int, classes: int):
        super().__init__()
        self.inp, self.labels = nn.Linear(dim, dim), nn.Embedding(classes, dim)
        self.blocks = nn.ModuleList(_Modulated(dim) for _ in range(blocks))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, c = self.inp(x), self.labels(y)
        for block in self.blocks:
            h = block(h, c)
        return self.out(h)


def conditioned(dim: int = 16, blocks: int = 3, classes: int = 5, frozen_labels: bool = False) -> ModelSpec:
    """`frozen_labels`: the label embedding trains not, so each block's modulation is made from its `mod`
    unit's parameters alone."""
    module = Conditioned(dim, blocks, classes)
    module.labels.weight.requires_grad_(not frozen_labels)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(5 * step + 4)
        return (torch.randn(batch_size, 8, dim, generator=g), torch.randint(0, classes, (batch_size,), generator=g)), \
            torch.randn(batch_size, 8, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


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


class _SavedAndSent(nn.Module):
    """u = b(h) is read by c (a Linear saves its input) in the unit after it and skips to f: cut after a
    and after c, the stage [b, c] sends on a value it also saved."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b, self.c, self.e, self.f = (nn.Linear(dim, dim) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.b(self.a(x))
        return self.f(self.e(torch.tanh(self.c(u))) + u)


def saved_and_sent(dim: int = 8) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(3 * step + 5)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=_SavedAndSent(dim), batch=batch, loss=F.mse_loss)


class _Latents(nn.Module):
    """Perceiver-style: a learned latent array expanded to the batch in the first unit (a view of the
    parameter, `copy=False`) and read by the next unit (a LayerNorm saves it)."""

    def __init__(self, dim: int, latents: int, copy: bool):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.latents = nn.Parameter(torch.randn(latents, dim) * 0.2)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, dim)
        self.copy = copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        lat = self.latents.unsqueeze(0).expand(x.shape[0], -1, -1)
        if self.copy:
            lat = lat.contiguous()
        return self.out(torch.cat([self.norm(lat), h], 1)).mean(1)


def latents(dim: int = 8, latents: int = 4, seq: int = 3, copy: bool = False) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(11 * step + 1)
        return (torch.randn(batch_size, seq, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=_Latents(dim, latents, copy), batch=batch, loss=F.mse_loss)


class _TwoTowers(nn.Module):
    """CLIP-like: an image tower on the stage's input side and a text tower from token ids, which a later stage
    holding it computes from its parameters alone (no gradient from the stage's inputs), fused by in-batch
    logits."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.tok = nn.Embedding(vocab, dim)
        self.txt = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, image: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        i = F.normalize(self.img(image), dim=-1)
        t = F.normalize(self.txt(self.tok(ids)).mean(1), dim=-1)
        return self.scale * i @ t.t()


def two_towers(dim: int = 8, vocab: int = 16, seq: int = 3) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(13 * step + 5)
        return (torch.randn(batch_size, dim, generator=g), torch.randint(0, vocab, (batch_size, seq), generator=g)), None

    def loss(logits: torch.Tensor, _) -> torch.Tensor:
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2

    return ModelSpec(module=_TwoTowers(dim, vocab), batch=batch, loss=loss)


class _SavedTwoApart(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.act = nn.ReLU()
        self.side = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inp(x))  # the ReLU saves h (its output)
        a = self.side(h.mean(1, keepdim=True))  # reads h, saves its mean only
        return self.head(self.out(h) + a)  # `out` saves h again: two units apart


def saved_two_apart(dim: int = 8, seq: int = 4) -> ModelSpec:
    """A storage two units that are not neighbours both save, none between them (an FPN's feature map its ReLU
    saves and a shared head's convolution two units on saves again; planner.cost.ranges' gap)."""
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(7 * step + 3)
        return (torch.randn(batch_size, seq, dim, generator=g),), torch.randn(batch_size, seq, dim, generator=g)

    return ModelSpec(module=_SavedTwoApart(dim), batch=batch, loss=F.mse_loss)




class _Joined(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([h, u], -1))


class _CatInputs(nn.Module):
    """The last unit, c, reads its two inputs through one concatenation, whose backward hands each its
    gradient as a narrow view of one tensor (not contiguous): cut before c, the gradients its stage sends."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b, self.d = (nn.Linear(dim, dim) for _ in range(3))
        self.c = _Joined(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(h, self.d(torch.tanh(self.b(h))))


def cat_inputs(dim: int = 8) -> ModelSpec:
    return ModelSpec(module=_CatInputs(dim), batch=saved_and_sent(dim).batch, loss=F.mse_loss)


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


class _LateEmbedding(nn.Module):
    """Token ids embedded by the second unit, whose input from the first (x's features) only passes
    through it: cut around it, that stage's one weight is reached from the model's ids alone."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.a, self.d = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.emb, self.c = nn.Embedding(vocab, dim), _Joined(dim)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.d(torch.tanh(self.c(h, self.emb(ids))))


def late_embedding(dim: int = 8, vocab: int = 12) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(7 * step + 2)
        x, target = torch.randn(batch_size, dim, generator=g), torch.randn(batch_size, dim, generator=g)
        return (x, torch.randint(0, vocab, (batch_size,), generator=g)), target

    return ModelSpec(module=_LateEmbedding(dim, vocab), batch=batch, loss=F.mse_loss)



class _Seq2Seq(nn.Module):
    """One embedding for source and target (tied to the output layer), a position parameter added to
    both, one projection applied at both ends, an encoder and a decoder layer whose cross-attention reads
    the encoder's output under a padding mask. Cut [2, 3, 5] (zb-v): stage 2 embeds the target and runs
    the decoder layer on the received memory, where torch's param groups share nodes."""

    def __init__(self, vocab: int, dim: int, seq: int):
        super().__init__()
        self.emb, self.proj = nn.Embedding(vocab, dim), nn.Linear(dim, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.enc = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        m = self.enc(self.proj(self.emb(src) + self.pos), src_key_padding_mask=pad)
        h = self.dec(self.emb(tgt) + self.pos, m, memory_key_padding_mask=pad)
        return self.out(self.proj(h)).flatten(0, 1)


def seq2seq(vocab: int = 16, dim: int = 8, seq: int = 5) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step + 3)
        src, tgt = (torch.randint(1, vocab, (batch_size, seq + 1), generator=g) for _ in range(2))
        pad = torch.arange(seq).unsqueeze(0) >= torch.randint(2, seq + 1, (batch_size, 1), generator=g)
        return (src[:, :-1], tgt[:, :-1], pad), tgt[:, 1:]

    return ModelSpec(module=_Seq2Seq(vocab, dim, seq), batch=batch,
                     loss=lambda logits, target: F.cross_entropy(logits, target.flatten()))
