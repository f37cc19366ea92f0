"""Option parsing shared by the `planner` subcommands."""
from __future__ import annotations

from typing import List

from planner.errors import UsageError


def parse_sizes(text: str) -> List[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise UsageError(f"--micro-batch-sizes {text!r} must be comma-separated integers, e.g. 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise UsageError("--micro-batch-sizes needs positive integers, e.g. 1,2,4")
    return sizes
