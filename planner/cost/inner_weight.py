"""What a later stage's weight part holds where the stage computes, from its own parameters, a value
its units read (UnitProfile.inner_weight_bytes): one definition for the cost model (planner.cost.ranges),
the solvers' stage tables (planner.cost.stage_memory) and the integer program's rows (planner.solve.ilp_memory).

A unit's profile is measured with every value it reads as a stage input, whose gradient the input part
computes. A value whose gradient flows back only into units from its source T on (planner.profile.profile_run's
`value_sources`: a shared position bias computed from a parameter in the first decoder block) carries no
gradient from the inputs of a stage starting at a <= T: the input part does not reach it, and the nodes
where it meets values that do keep their gradients for the weight part (where every value it meets is such
a one too, less may be held). The profile measures unit k with the values of source >= T so, for each
source T of its inputs: with the pairs (k, T, x), x what it then holds more than with those of source > T
so (negative: less), a stage [a, e) whose weight part is not its whole backward (a > 0,
planner.cost.ranges' `whole`) holds

    inner(a, e) = sum_{(k, T, x): a <= T, k < e} x          (T < k: both units in the stage)

per micro-batch between its parts, with or without recomputation (what is kept are gradients).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

Pair = Tuple[int, int, float]  # (reader unit k, source unit T, bytes x)


def inner_pairs(units: Sequence, b: int) -> List[Pair]:
    """The pairs of a profile's units at micro-batch size b."""
    return [(k, int(source), float(x)) for k, unit in enumerate(units)
            for source, x in unit.inner_weight_bytes.get(b, {}).items() if x]


def inner_held(pairs: Sequence[Pair], a: int, e: int) -> float:
    """inner(a, e) (module docstring) of a stage that is not whole."""
    return float(sum(x for k, source, x in pairs if a <= source and k < e))


def inner_rows(pairs: Sequence[Pair], starts: np.ndarray, cuts: int) -> np.ndarray:
    """inner(a, e) for a in `starts` (rows) and e = 0 .. cuts - 1 (columns); cells with e <= a hold any value."""
    out = np.zeros((len(starts), cuts))
    for k, source, x in pairs:
        out[np.ix_(starts <= source, np.arange(k + 1, cuts))] += x
    return out
