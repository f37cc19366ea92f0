"""Subnormal floats on the CPU: whether this process flushes them to zero.

A CPU computes on subnormal floats (below 1.2e-38 in fp32) many times slower than on normal ones, so a
unit's time can depend on the values it computes on: a freshly initialised T5's logits make 1.3 % of its
softmax probabilities subnormal and its `lm_head` backward ran 5x slower at the profile's initial
weights than in the runs a few steps later (BENCHMARKS.md, "Held-out model kinds under every
schedule"). Flushing them (`torch.set_flush_denormal`: flush-to-zero and denormals-are-zero, the CPU's
own modes) makes the speed independent of the weights' state. `planner profile` measures so by default
and records it (`Profile.flush_subnormals`); the plan carries it and every rank computes the same way
(runtime.rank_setup), so a plan is timed on the arithmetic its run does. Values below 1.2e-38 become 0
(where a model's results depend on them, `planner profile --keep-subnormals` keeps them, and its ranks do).
CUDA devices are not affected: the setting is the host CPU's."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def flushing() -> bool:
    """Whether this process's CPU arithmetic now flushes subnormal floats (read from the arithmetic
    itself: torch has no getter)."""
    return bool((torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() == 0.0)


def set_flushing(on: bool) -> bool:
    """Flush subnormal floats (or stop) in this process; return what now holds (a CPU without the
    modes keeps computing on them: False)."""
    torch.set_flush_denormal(bool(on))
    return flushing()


@contextmanager
def flushed(on: bool) -> Iterator[bool]:
    """Compute with subnormals flushed (`on`) or kept inside the block, as it was after; yields what holds."""
    before = flushing()
    try:
        yield set_flushing(on)
    finally:
        set_flushing(before)
