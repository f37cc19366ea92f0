"""A GPT-style language model: token + position embedding, N pre-norm transformer blocks,
a final norm and an untied LM head over a large vocabulary.

With a large vocabulary the head costs as much as several blocks: the classic imbalance
that equal-layer-count splits get wrong.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, seq_len: int):
        super().__init__()
        self.heads = heads
        self.dim = dim
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Static sizes are Python ints and dynamic ones come from size(): the block stays
        # traceable by torch.fx (a traced shape cannot be unpacked).
        batch, seq = x.size(0), x.size(1)
        dim, head_dim = self.dim, self.dim // self.heads
        qkv = self.qkv(self.ln1(x))
        q, k, v = qkv[..., :dim], qkv[..., dim:2 * dim], qkv[..., 2 * dim:]
        q = q.reshape(batch, seq, self.heads, head_dim).transpose(1, 2)
        k = k.reshape(batch, seq, self.heads, head_dim).transpose(1, 2)
        v = v.reshape(batch, seq, self.heads, head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim) + self.mask[:seq, :seq]
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, seq_len) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(vocab: int = 2048, dim: int = 64, layers: int = 4, heads: int = 4, seq_len: int = 32) -> ModelSpec:
    if dim % heads:
        raise ValueError(f"gpt: dim={dim} must be divisible by heads={heads}")
    model = GPT(vocab, dim, layers, heads, seq_len)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(1_000_003 * step + 17)
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        return (tokens[:, :-1],), tokens[:, 1:]

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return ModelSpec(module=model, batch=batch, loss=loss)
