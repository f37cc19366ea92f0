"""Option parsing shared by the `planner` subcommands."""
from __future__ import annotations

from typing import List

from planner.errors import UsageError


MAX_MICRO_BATCH_SIZE = 1 << 24  # samples per micro-batch: beyond, a typo (99999999999 stopped in the allocator)


def parse_sizes(text: str) -> List[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise UsageError(f"--micro-batch-sizes {text!r} must be comma-separated integers, e.g. 1,2,4") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > MAX_MICRO_BATCH_SIZE:
        raise UsageError(f"--micro-batch-sizes needs integers 1 to {MAX_MICRO_BATCH_SIZE}, e.g. 1,2,4")
    return sizes
