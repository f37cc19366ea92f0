"""Small models for runtime tests: entry points `tests.models:NAME`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


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
    from planner.model.builtin.mlp import build

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


class BranchBlock(nn.Module):
    """A residual block with Python control flow on a shape (torch.fx cannot trace it)."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x):
        h = torch.relu(self.norm(self.fc(x)))
        if x.shape[-1] % 2 == 0:  # a shape-dependent branch: fx raises, export specialises
            h = h * 0.5
        return x + h


class ShapeBranch(nn.Module):
    """Export-only: shape-dependent branches, BatchNorm buffers, keyword input, dict output."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(BranchBlock(dim) for _ in range(layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x, shift=None):
        h = self.inp(x)
        if shift is not None:
            h = h + shift
        for block in self.blocks:
            h = block(h)
        return {"y": self.out(h), "features": h}


def shape_branch(dim: int = 8, layers: int = 4, keyword: bool = False) -> ModelSpec:
    """`keyword=True` passes `shift` as a keyword tensor (inputs end with a dict)."""
    module = ShapeBranch(dim, layers)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        x, shift, y = (torch.randn(batch_size, dim, generator=g) for _ in range(3))
        return ((x, {"shift": shift}) if keyword else (x, shift)), y

    def loss(output, target):
        return F.mse_loss(output["y"], target) + 0.1 * output["features"].pow(2).mean()

    return ModelSpec(module=module, batch=batch, loss=loss)


class ValueGate(nn.Module):
    """Control flow on a tensor's value: neither torch.fx nor torch.export can capture it."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class ValueBranch(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.gate = ValueGate()

    def forward(self, x):
        return self.gate(self.fc(x))


def value_branch(dim: int = 4) -> ModelSpec:
    """A model no capture path takes (for the one-line error of `planner profile`)."""
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=ValueBranch(dim), batch=batch, loss=F.mse_loss)


class TiedLM(nn.Module):
    """Input embedding and output head share one weight (as GPT-2 and T5 do). With `aliased_bias`,
    the head's bias is also the model's `bias`: one Parameter under two names, which the graph reads
    under one of them (as Hugging Face BERT's `cls.predictions.bias` and `...decoder.bias`)."""

    def __init__(self, vocab: int, dim: int, layers: int, aliased_bias: bool = False, side: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.side = nn.Linear(dim, dim) if side else None  # before the last block, reading the embedding
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        if aliased_bias:
            self.bias = nn.Parameter(torch.zeros(vocab))
            self.head.bias = self.bias

    def forward(self, idx):
        h = first = self.emb(idx)
        aside = None
        for k, block in enumerate(self.blocks):
            if self.side is not None and k == len(self.blocks) - 1:
                aside = self.side(first)  # a unit of its own, before the last block
            h = h + torch.tanh(block(h))
        return self.head(h if aside is None else h + aside)


def tied_lm(vocab: int = 64, dim: int = 16, layers: int = 3, seq: int = 8, aliased_bias: bool = False,
            side: bool = False) -> ModelSpec:
    module = TiedLM(vocab, dim, layers, aliased_bias, side)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step + 5)
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
        return (tokens[:, :-1],), tokens[:, 1:]

    def loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return ModelSpec(module=module, batch=batch, loss=loss)


def killed(kill_step: int = 1) -> ModelSpec:
    """An MLP whose last rank kills itself with SIGKILL at `kill_step` (no error file, no goodbye)."""
    import os
    import signal

    from planner.model.builtin.mlp import build

    spec = build(layers=2)
    loss_fn = spec.loss
    calls = {"n": 0}

    def loss(output, target):
        calls["n"] += 1
        if os.environ.get("RANK") and calls["n"] > kill_step * 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss_fn(output, target)

    return ModelSpec(module=spec.module, batch=spec.batch, loss=loss)


class Tables(nn.Module):
    """Large parameters, little compute: each layer adds the mean of a few rows of its own table
    (rows x dim), so the bytes crossing a cut do not depend on `rows`."""

    def __init__(self, rows: int, dim: int, layers: int):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, dim) for _ in range(layers))

    def forward(self, x, ids):
        for table in self.tables:
            x = torch.tanh(x + table(ids).mean(1))
        return x


def tables(rows: int = 1000, dim: int = 32, layers: int = 4) -> ModelSpec:
    """`tables(rows=2**21)`: 4 x 256 MiB of parameters (tests/runtime/test_init_state.py's peak RSS)."""
    module = Tables(rows, dim, layers)

    def batch(n: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(n, dim, generator=g), torch.randint(0, rows, (n, 4), generator=g)), \
            torch.randn(n, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=lambda out, target: F.mse_loss(out, target))


class DropoutChain(nn.Module):
    def __init__(self, dim: int, layers: int, p: float, dropping: int):
        super().__init__()
        # (no dropout module at all where none drops: torch's dropout draws a mask even at p = 0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), *([nn.Dropout(p)] if k < dropping else []))
                                    for k in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def dropout_mlp(dim: int = 16, layers: int = 4, p: float = 0.3, dropping: int = -1) -> ModelSpec:
    """Dropout after every layer (the first `dropping` ones only, when not -1): a resumed run is exact
    only if the random generators resume too."""
    module = DropoutChain(dim, layers, p, layers if dropping < 0 else dropping)

    def batch(n: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(n, dim, generator=g),), torch.randn(n, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=lambda out, target: F.mse_loss(out, target))


def sequential(dim: int = 16, layers: int = 4) -> ModelSpec:
    """A bare nn.Sequential: its forward's argument is `input`, which fx renames (node `input_1`)."""
    module = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.ReLU())), nn.Linear(dim, 4))

    def batch(n: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(n, dim, generator=g),), torch.randint(0, 4, (n,), generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.cross_entropy)


def one_element_loss(dim: int = 16, layers: int = 4) -> ModelSpec:
    """`sequential` whose loss has shape (1,), not (): one element, trained as a scalar loss."""
    spec = sequential(dim, layers)
    return ModelSpec(module=spec.module, batch=spec.batch, loss=lambda out, t: F.cross_entropy(out, t).reshape(1))


def frozen_tied_lm(layers: int = 3, side: bool = False) -> ModelSpec:
    """tied_lm fine-tuned: the embedding (tied to the head) and the first block frozen
    (requires_grad=False), the other blocks trained. With `side`, a frozen unit before the last block
    reads the embedding (no gradient) while the blocks' output, which carries one, passes it by."""
    spec = tied_lm(layers=layers, side=side)
    spec.module.emb.weight.requires_grad_(False)
    spec.module.blocks[0].requires_grad_(False)
    if side:
        spec.module.side.requires_grad_(False)
    return spec


class TwoOutputs(nn.Module):
    """Two outputs: the main one, and an auxiliary head computed in the second unit (so it crosses
    every later cut to reach the output); the last unit reads the model's input again."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.aux_head = nn.Linear(dim, 3)
        self.mid = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        aux = self.aux_head(h)
        for layer in self.mid:
            h = h + torch.relu(layer(h))
        return self.out(h) + x, aux


def two_outputs(dim: int = 8, layers: int = 3) -> ModelSpec:
    """Two outputs and a target of two tensors (a tuple)."""
    module = TwoOutputs(dim, layers)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step + 11)
        x = torch.randn(batch_size, dim, generator=g)
        return (x,), (torch.randn(batch_size, dim, generator=g), torch.randint(0, 3, (batch_size,), generator=g))

    def loss(outputs, target):
        out, aux = outputs
        return F.mse_loss(out, target[0]) + F.cross_entropy(aux, target[1])

    return ModelSpec(module=module, batch=batch, loss=loss)


class GatedBranch(nn.Module):
    """A layer whose output reaches the loss only through a comparison (`gate`: no gradient, so
    single-process training leaves its weight's gradient None), crossing the cuts after it beside
    the hidden state, which does carry one. With `tied`, a second such gate after the middle layers
    shares its weight (a tie no gradient reaches)."""

    def __init__(self, dim: int, layers: int, tied: bool = False):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)
        self.mid = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.gate2 = nn.Linear(dim, dim, bias=False) if tied else None
        if tied:
            self.gate2.weight = self.gate.weight
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        g = self.gate(h)
        for layer in self.mid:
            h = h + torch.relu(layer(h))
        if self.gate2 is not None:
            h = h * (self.gate2(h) > 0).to(h.dtype)
        return self.out(h * (g > 0).to(h.dtype))


def gated_branch(dim: int = 8, layers: int = 3, tied: bool = False) -> ModelSpec:
    module = GatedBranch(dim, layers, tied)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step + 5)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


def bad_batch(kind: str = "bare") -> ModelSpec:
    """A batch function a user gets wrong: `bare` returns a tensor, not a tuple, for the inputs;
    `target` a target without the batch dimension."""
    def batch(n: int, step: int):
        x, y = torch.randn(n, 4), torch.randn(n, 4)
        return (x, y) if kind == "bare" else ((x,), torch.randn(4))

    return ModelSpec(module=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), batch=batch, loss=F.mse_loss)


class FFT(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x, dim=-1)


class ComplexMix(nn.Module):
    """A learned complex scale: its gradient flows back through complex activations."""

    def __init__(self, dim: int):
        super().__init__()
        self.wr = nn.Parameter(torch.randn(dim) * 0.5)
        self.wi = nn.Parameter(torch.randn(dim) * 0.5)

    def forward(self, z):
        return z * torch.complex(self.wr, self.wi).to(z.dtype)


class InverseFFT(nn.Module):
    def forward(self, z):
        return torch.fft.ifft(z, dim=-1).real


class ComplexMixer(nn.Module):
    """An FFT mixer whose activations are complex between `fft` and `ifft` (units: a, fft, mix, ifft,
    b); with `skip`, the real input of the FFT also crosses those cuts (a message of two dtypes)."""

    def __init__(self, dim: int, double: bool, skip: bool):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.fft = FFT()
        self.mix = ComplexMix(dim)
        self.ifft = InverseFFT()
        self.b = nn.Linear(dim, dim)
        self.double, self.skip = double, skip

    def forward(self, x):
        h = self.a(x)
        z = self.mix(self.fft(h.double() if self.double else h))
        out = self.b(self.ifft(z).float())
        return out + h if self.skip else out


def complex_mixer(dim: int = 8, dtype: str = "complex64", skip: bool = False) -> ModelSpec:
    module = ComplexMixer(dim, dtype == "complex128", skip)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step + 22)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class LazyMLP(nn.Module):
    """Linear layers whose input sizes are inferred on the first forward (parameters created then);
    `norm` "batch" or "lazy": a BatchNorm (a lazy one: its statistics too are made by that forward)
    whose running statistics that forward must not change."""

    def __init__(self, dim: int, norm: str):
        super().__init__()
        self.a = nn.LazyLinear(dim)
        self.b = nn.Linear(dim, dim)
        self.norm = {"batch": nn.BatchNorm1d(dim), "lazy": nn.LazyBatchNorm1d()}.get(norm, nn.Identity())
        self.c = nn.LazyLinear(dim)

    def forward(self, x):
        return self.c(self.norm(torch.tanh(self.b(torch.tanh(self.a(x))))))


def lazy_mlp(dim: int = 8, inputs: int = 6, norm: str = "none") -> ModelSpec:
    module = LazyMLP(dim, norm)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step + 50)
        return (torch.randn(batch_size, inputs, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class BroadcastCut(nn.Module):
    """`y` and a broadcast view of it (one storage in the model) cross the cut after `a`; `b` saves
    both. A rank receives each in a storage of its own, the view materialised."""

    def __init__(self, dim: int, copies: int, classes: int):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, classes)
        self.copies = copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        wide = y.unsqueeze(1).expand(-1, self.copies, -1)
        return self.head((wide * torch.sigmoid(self.b(y)).unsqueeze(1)).sum(1))


def broadcast_cut(dim: int = 16, copies: int = 3, classes: int = 32) -> ModelSpec:
    """A classifier (cross-entropy: the loss keeps its log-probabilities) over BroadcastCut."""
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, dim, generator=g),), torch.randint(0, classes, (batch_size,), generator=g)

    return ModelSpec(module=BroadcastCut(dim, copies, classes), batch=batch, loss=F.cross_entropy)


class SelfAttentionChain(nn.Module):
    """Layers whose input is saved by operations a zero-bubble input part frees (x @ x^T, the
    scaling by x) and by the layer before it: after a later stage's input part only the layer
    before still holds it."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = F.gelu(torch.softmax(x @ x.transpose(1, 2) / 4.0, -1) @ x)
            y = torch.exp(torch.sin(y)) * torch.cos(y)
            x = layer(y).mean(-1, keepdim=True) * x + y
        return x


def self_attention_chain(dim: int = 16, layers: int = 3, seq: int = 12) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, seq, dim, generator=g),), torch.randn(batch_size, seq, dim, generator=g)

    return ModelSpec(module=SelfAttentionChain(dim, layers), batch=batch, loss=F.mse_loss)


class SavedWrite(nn.Module):
    """A block that writes, in place, a tensor its own sine saved for backward: wrong in any
    process (autograd refuses the backward), and a counted step must refuse it too."""

    def __init__(self, dim: int):
        super().__init__()
        self.first, self.second = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        y = self.first(x)
        z = torch.sin(y)
        y.mul_(2)
        return self.second(z + y)


def _regression(module: nn.Module, dim: int) -> ModelSpec:
    """`module` trained towards random targets of width `dim` (mean squared error), batches seeded by step."""
    def batch(n: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(n, dim, generator=g),), torch.randn(n, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=lambda out, target: F.mse_loss(out, target))


def saved_write(dim: int = 8) -> ModelSpec:
    return _regression(SavedWrite(dim), dim)


def exits(where: str = "loss", step: int = 0) -> ModelSpec:
    """A model whose batch or loss function calls sys.exit (at `step` and after, for the batch)."""
    import sys

    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    def batch(n: int, s: int):
        if where == "batch" and s >= step:
            sys.exit(3)
        g = torch.Generator().manual_seed(s)
        return (torch.randn(n, 4, generator=g),), torch.randn(n, 4, generator=g)

    def loss(out, target):
        if where == "loss":
            sys.exit(3)
        return F.mse_loss(out, target)

    return ModelSpec(module=module, batch=batch, loss=loss)


def odd_batch(kind: str = "none") -> ModelSpec:
    """A model whose batch function returns no (inputs, target) pair: None, or three values."""
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    def batch(n: int, s: int):
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(s))
        return None if kind == "none" else ((x,), x, x)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class FrozenLayers(nn.Module):
    """Four layers, the first and the third frozen: a stage after the first gets inputs that need
    no gradient (its weight part reaches the loss's seed)."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b, self.c, self.e = (nn.Linear(dim, dim) for _ in range(4))
        for p in [*self.a.parameters(), *self.c.parameters()]:
            p.requires_grad_(False)

    def forward(self, x):
        return self.e(torch.tanh(self.c(torch.relu(self.b(torch.tanh(self.a(x)))))))


def frozen_layers(dim: int = 16) -> ModelSpec:
    return _regression(FrozenLayers(dim), dim)


class ViewOutputs(nn.Module):
    """Every layer ends in a view of its result (as a Llama decoder layer's output is): each stage
    sends a view."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        n = x.shape[0]
        for layer in self.layers:
            x = torch.tanh(layer(x)).view(n, 2, -1).flatten(1)
        return x


def view_outputs(dim: int = 16, layers: int = 4) -> ModelSpec:
    return _regression(ViewOutputs(dim, layers), dim)


class NormedMLP(nn.Module):
    """Linear layers each followed by BatchNorm and ReLU (autocast runs batch_norm in fp32: its
    input cast up, its output fp32) and a last Linear."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU())
                                    for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def normed_mlp(dim: int = 16, layers: int = 3) -> ModelSpec:
    return _regression(NormedMLP(dim, layers), dim)


class TanhEnd(nn.Module):
    """Linear layers ending in tanh before the loss: the last unit saves its bf16 output (tanh's
    backward), and the MSE loss saves its own fp32 copy of it under autocast."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def tanh_end(dim: int = 16, layers: int = 4) -> ModelSpec:
    return _regression(TanhEnd(dim, layers), dim)


class RMSNormFP32(nn.Module):
    """T5's norm: computed in fp32 and scaled by an fp32 weight (one-dimensional: no compute copy),
    so under autocast its output is fp32 whatever its input's dtype."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class NormedReaders(nn.Module):
    """An encoder whose output is fp32 under autocast (T5's final norm, RMSNormFP32), read by
    several Linear layers after it (T5's cross-attention keys and values): cut after the norm,
    that fp32 value crosses and each reader casts it to bf16."""

    def __init__(self, dim: int, readers: int):
        super().__init__()
        self.enc = nn.Linear(dim, dim)
        self.norm = RMSNormFP32(dim)
        self.readers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(readers))

    def forward(self, x):
        e = self.norm(self.enc(x))
        h = torch.zeros_like(x)
        for reader in self.readers:
            h = torch.tanh(reader(e) + h)
        return h


def normed_readers(dim: int = 16, readers: int = 4) -> ModelSpec:
    return _regression(NormedReaders(dim, readers), dim)


def frozen_embedding_lm(layers: int = 3) -> ModelSpec:
    """tied_lm with its head untied and its embedding frozen (fine-tuning over fixed embeddings): the
    embedding's unit has no backward (no parameter that trains, integer inputs), the others do."""
    spec = tied_lm(layers=layers)
    spec.module.head.weight = nn.Parameter(spec.module.emb.weight.detach().clone())
    spec.module.emb.weight.requires_grad_(False)
    return spec


class LatentAttention(nn.Module):
    """A Perceiver-IO's cross-attention: a latent parameter expanded over the batch crosses a cut as the query
    of batch_first nn.MultiheadAttention layers (the expanded value reaches the later unit as a view of a leaf
    spanning its storage: planner.profile)."""

    def __init__(self, dim: int, latents: int, layers: int, heads: int):
        super().__init__()
        self.latent = nn.Parameter(torch.randn(latents, dim))
        self.embed = nn.Linear(dim, dim)
        self.attention = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = self.latent.expand(x.shape[0], -1, -1)
        x = self.embed(x)
        for attention in self.attention:
            query = query + attention(query, x, x, need_weights=False)[0]
        return query.mean(1)


def latent_attention(dim: int = 16, latents: int = 4, layers: int = 2, heads: int = 2, seq: int = 6) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, seq, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=LatentAttention(dim, latents, layers, heads), batch=batch, loss=F.mse_loss)


class ChannelsLastBlock(nn.Module):
    """A ConvNeXt-like block: a depthwise convolution, then a per-pixel MLP over channels-last
    values permuted back: its output (the residual stream) lies channels-last in memory."""

    def __init__(self, channels: int):
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.mlp = nn.Linear(channels, channels)

    def forward(self, x):
        h = self.mlp(self.dw(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return x + h


class ChannelsLastNet(nn.Module):
    """A stem, blocks whose outputs lie channels-last (each cut between blocks carries one such
    tensor, and with `skip` the stem's output beside it: a message of two), and a head."""

    def __init__(self, channels: int, blocks: int, skip: bool):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 2, stride=2)
        self.blocks = nn.ModuleList(ChannelsLastBlock(channels) for _ in range(blocks))
        self.head = nn.Linear(channels, 4)
        self.skip = skip

    def forward(self, x):
        s = self.stem(x).to(memory_format=torch.channels_last)
        h = s
        for block in self.blocks:
            h = block(h)
        if self.skip:
            h = h + s
        return self.head(h.mean(dim=(2, 3)))


def channels_last(channels: int = 8, blocks: int = 3, skip: bool = False) -> ModelSpec:
    module = ChannelsLastNet(channels, blocks, skip)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step + 31)
        return (torch.randn(batch_size, 3, 8, 8, generator=g),), torch.randn(batch_size, 4, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


class SlicedOutput(nn.Module):
    """A sequence model returning, beside its head's output, a slice of a larger value for the loss to
    read squared (which saves the slice): of a copy the last unit makes (`flip`: the loss keeps all of
    it), of a value it receives (`view`: the recomputed unit keeps that anyway), of a parameter (`table`: held
    anyway) or a copy of the slice."""

    def __init__(self, dim: int, layers: int, second: str):
        super().__init__()
        self.second = second
        self.table = nn.Parameter(torch.randn(64, dim))  # `table`: a slice of a parameter (held anyway)
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        if self.second == "flip":
            return self.out(h[:, -1]), h.flip(1)[:, 0]
        if self.second == "view":
            return self.out(h[:, -1]), h[:, 0]
        if self.second == "table":
            return self.out(h[:, -1]) + self.table[0], self.table[: h.shape[0]]
        return self.out(h[:, -1]), h[:, 0].clone()


def sliced_output(dim: int = 8, layers: int = 3, seq: int = 5, second: str = "flip") -> ModelSpec:
    def batch(n: int, step: int):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(n, seq, dim, generator=g),), torch.randn(n, dim, generator=g)

    def loss(output, target):
        head, side = output
        return F.mse_loss(head, target) + 0.1 * side.pow(2).mean()

    return ModelSpec(module=SlicedOutput(dim, layers, second), batch=batch, loss=loss)


class TimeMajorGrads(nn.Module):
    """A Linear reading a sequence that lies time-major in memory (as a batch-first GRU's output does),
    then a batch-first LSTM, whose backward hands its input's gradient back time-major. The Linear runs
    as a matmul and a bias addition; its weight part keeps the bias's gradient as it arrives and the
    matmul's contiguous copy of it: two storages where that gradient lies time-major, one where it lies
    as the value does (planner.profile.cut_profile's grad_order)."""

    def __init__(self, dim: int):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.mid = nn.Linear(dim, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.inp(x.transpose(0, 1)).transpose(0, 1)  # batch-first, lying time-major
        l, _ = self.lstm(torch.tanh(self.mid(h)))
        return self.out(l[:, -1])


def time_major_grads(dim: int = 8, seq: int = 5) -> ModelSpec:
    module = TimeMajorGrads(dim)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(step + 37)
        return (torch.randn(batch_size, seq, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)
