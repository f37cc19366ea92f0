"""Test models for `--engine torch` under zb-v, whose backward is split into an input part and a
weight part by torch's helpers: values sent on and also saved, input gradients that are views,
a later embedding, param groups sharing autograd nodes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


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
