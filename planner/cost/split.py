"""A plan's units per stage, over one profile's range costs: what planner.cost.model evaluates."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import FrozenSet, Tuple

from planner.cost.ranges import RangeCosts


@dataclass(frozen=True)
class Split:
    """A plan's units per stage: stage g holds units [edges[g], edges[g + 1]); `redo` is recomputed."""

    costs: RangeCosts
    edges: Tuple[int, ...]
    redo: FrozenSet[int]
    dtype: str = "float32"  # the profile's (planner.cost.memory: bytes per parameter byte)
    fixed: float = 0.0  # F: bytes every device holds besides its stages (`fixed_bytes`)

    def units(self, g: int) -> Tuple[int, int]:
        return self.edges[g], self.edges[g + 1]

    @functools.cached_property
    def stage_of(self) -> Tuple[int, ...]:
        """The stage of each unit."""
        return tuple(g for g in range(len(self.edges) - 1) for _ in range(*self.units(g)))
