"""Test models for what crosses a cut and what a stage saves: an alias beside its tensor, a table
two layers save, values made from parameters alone (a gate, a conditioning, a text tower), a view
of a parameter passed on, one storage saved two units apart, a recurrent cell's steps and class-token blocks reading
a sequence and a view of it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec
from tests.capture_models.writes import to_random_targets


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
    module = AliasCross(dim, kind)

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(3 * step + 5)
        return (torch.randn(batch_size, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=module, batch=batch, loss=F.mse_loss)


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


class Broadcast(nn.Module):
    """A value `expand`ed to four times its storage handed from unit a to b and to the head: its elements
    share memory, so the unit reading it cannot be given it as a leaf (a second gradient reaching it is
    added in place into the first, itself a broadcast view)."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(dim, 2 * dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.randn(4, dim) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        e = h[:, :x.shape[1]].unsqueeze(1).expand(-1, 4, -1)
        u = torch.tanh(self.b(e * self.scale)).mean(1)
        return self.c(u) * e.sum(1)


def broadcast(dim: int = 8) -> ModelSpec:
    torch.manual_seed(8)
    return to_random_targets(Broadcast(dim), dim, 3, 1)


class _CellStep(nn.Module):
    """One time step of a recurrent cell that every step shares."""

    def __init__(self, cell: nn.Module, lstm: bool):
        super().__init__()
        self.cell, self.lstm = cell, lstm

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        return self.cell(x, (h, c)) if self.lstm else (self.cell(x, h), c)


class Unrolled(nn.Module):
    """An unrolled LSTM (GRU) cell, one unit per time step, all steps one cell's weights: each step reads the
    projected sequence and its own step of it, x[:, t], a view of that one storage (recomputed, a step keeps
    both: one storage inside a stage, two where received)."""

    def __init__(self, dim: int, steps: int, lstm: bool):
        super().__init__()
        self.inp, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        cell = nn.LSTMCell(dim, dim) if lstm else nn.GRUCell(dim, dim)
        self.steps = nn.ModuleList(_CellStep(cell, lstm) for _ in range(steps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        h = c = torch.zeros_like(x[:, 0])
        for t, step in enumerate(self.steps):
            h, c = step(x[:, t], h, c)
        return self.out(h)


def unrolled(dim: int = 8, steps: int = 3, cell: str = "lstm") -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(5 * step + 2)
        return (torch.randn(batch_size, steps, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=Unrolled(dim, steps, cell == "lstm"), batch=batch, loss=F.mse_loss)


class _ClassBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.seq, self.cls = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.seq(h) + self.cls(cls).unsqueeze(1))


class ClassToken(nn.Module):
    """Blocks each reading the sequence and its class token h[:, 0], a view of it (a ViT's pooled query)."""

    def __init__(self, dim: int, blocks: int):
        super().__init__()
        self.embed, self.head = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_ClassBlock(dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, h[:, 0])
        return self.head(h[:, 0])


def class_token(dim: int = 8, blocks: int = 3, seq: int = 4) -> ModelSpec:
    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(3 * step + 1)
        return (torch.randn(batch_size, seq, dim, generator=g),), torch.randn(batch_size, dim, generator=g)

    return ModelSpec(module=ClassToken(dim, blocks), batch=batch, loss=F.mse_loss)
