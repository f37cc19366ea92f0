"""Each rank's random stream: what random operations in its stages (dropout, noise, sampling) draw.

Every rank builds the model after `torch.manual_seed(seed)` (identical weights), so every rank's
generator would then hand out the same numbers: a later stage's dropout the masks an earlier
stage's layer drew for the same micro-batch, and every data-parallel replica the same masks for
different samples. Rank 0 keeps the stream one process has once the model is built (so random
operations that all run on rank 0 draw what one process draws; not with `--init-state`, whose model
is built on meta, which draws nothing); every other rank starts a stream
of its own from (seed, rank). Independent masks across stages and replicas, the same every run,
kept by checkpoints. Not one process's numbers where several ranks draw: one process draws them in
another order (every micro-batch's whole forward before the next), which no pipeline keeps.
"""
from __future__ import annotations

import hashlib

import torch


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s stream (rank > 0) for the model's `seed`."""
    digest = hashlib.sha256(f"pipeline-planner/{seed}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch.manual_seed takes up to 2**63 - 1


def start_stream(seed: int, rank: int, built_state: torch.Tensor) -> None:
    """Set this process's generators to rank `rank`'s stream; `built_state`: the CPU generator's
    state right after the model was built (rank 0 continues it)."""
    if rank == 0:
        torch.set_rng_state(built_state)
    else:
        torch.manual_seed(rank_seed(seed, rank))  # every device's generator
