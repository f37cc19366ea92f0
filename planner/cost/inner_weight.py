"""What a later stage's weight part holds where the stage computes, from its own parameters, a value
its units read (UnitProfile.inner_weight_bytes): one definition for the cost model (planner.cost.ranges),
the solvers' stage tables (planner.cost.stage_memory) and the integer program's rows (planner.solve.ilp_memory).

A unit's profile is measured with every value it reads as a stage input, whose gradient the input part
computes. A value whose gradient flows back only into units from its source T on (planner.profile.profile_run's
`value_sources`: a shared position bias computed from a parameter in the first decoder block) carries no
gradient from the inputs of a stage starting at a <= T: the input part does not reach it, and the nodes
where it meets values that do keep their gradients for the weight part (where every value it meets is such
a one too, less may be held). The profile measures unit k with the values of source >= T so, for each
source T of its inputs: what it then holds more (less) than with those of source > T so, Dh_kT, and of
that its kept gradients, Dk_kT. A stage [a, e) whose weight part is not its whole backward (a > 0,
planner.cost.ranges' `whole`) holds, per micro-batch between its parts,

    inner(a, e) = sum_{(k, T, x): a <= T, k < e} x          (T < k: both units in the stage)

over pairs (k, T, x): (k, T, Dk_kT) for every such unit, as each holds its kept gradients; and the rest,
Da = max(Dh_kT - Dk_kT, 0) (the saved tensors it still holds), only where unit k counts its h rather than all
it saved (planner.cost.ranges: the units from the stage's last trained one on, where that one is followed by
frozen units only, else its last unit): with F_k the next unit that trains, (k, T, Da) and (F_k, T, -Da)
(the sum is Da for k < e <= F_k: the units after k in the stage all frozen); for a frozen unit k with t the
last unit before it that trains, so with min(T, t) for T where t >= a, and where t < a <= T only as the
stage's last unit (e = k + 1: pairs at k and k + 1); none of them where unit k is recomputed (it holds its
inputs and kept gradients). A unit after a recomputed one may so count Da where it does not hold it
(planner.cost.ranges then has the stage's last unit hold h): an over-count, never under (Da >= 0). Without
the kept part measured, (k, T, Dh_kT). A unit j >= 1 whose output v is made from its parameters alone keeps
v's gradient when profiled alone (UnitProfile.inner_seed_bytes, in its k_j) but not in a stage holding v's
last reader R_v: (R_v, j, -bytes of v). So too an output v of unit k whose source is T < k (made
from values of sources >= T and its parameters): measured with the values of source >= T left to the weight part, unit k keeps v's gradient
(in Dk_kT), which a stage from T on holding R_v does not (a text tower computed from token ids: each layer's
output; UnitProfile.inner_seed_sources names T): (R_v, T, -bytes of v). Pairs that never apply (T < 1, k = L)
are left out.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np

# (reader unit k, source unit T, bytes x, holder h): h >= 0 where x is unit h's saved part, held only where h
# is not recomputed (a recomputed unit holds its inputs and kept gradients); -1 where it always applies
Pair = Tuple[int, int, float, int]


def inner_pairs(units: Sequence, b: int, crossing: Sequence[Sequence[str]] = ()) -> List[Pair]:
    """The pairs of a profile's units at micro-batch size b (module docstring); `crossing[c - 1]`: the names
    of the values crossing cut c."""
    L = len(units)
    last_reader = {name: c for c, names in enumerate(crossing, start=1) for name in names}
    trains = [k for k, unit in enumerate(units) if unit.trainable_bytes > 0]
    pairs: List[Pair] = []
    for k, unit in enumerate(units):
        held, kept = unit.inner_weight_bytes.get(b, {}), unit.inner_kept_bytes.get(b)
        after = next((f for f in trains if f > k), L)  # F_k: units k + 1 .. F_k - 1 are frozen
        before = max((t for t in trains if t < k), default=-1)  # the last unit before k that trains
        for source, x in held.items():
            T = int(source)
            if kept is None:
                pairs.append((k, T, float(x), -1))
                continue
            pairs.append((k, T, float(kept.get(source, 0)), -1))
            rest = max(float(x) - kept.get(source, 0), 0.0)
            if unit.trainable_bytes > 0:  # it holds its h where the units after it in the stage are frozen
                pairs += [(k, T, rest, k), (after, T, -rest, k)]
                continue
            # frozen: so too where a unit before it in the stage trains; else only as the stage's last unit
            low = min(T, before)
            pairs += [(k, low, rest, k), (after, low, -rest, k), (k, T, rest, k), (k + 1, T, -rest, k),
                      (k, low, -rest, k), (k + 1, low, rest, k)]
        # its outputs made from its parameters alone: their gradients, kept alone, kept in a stage only where
        # the value crosses the stage's end (some reader after it)
        pairs += [(last_reader[name], unit.inner_seed_sources.get(name, k), -float(x), -1)
                  for name, x in unit.inner_seed_bytes.get(b, {}).items() if name in last_reader]
    merged: Dict[Tuple[int, int, int], float] = {}  # one pair per (k, T, h): those that cancel go
    for k, T, x, h in pairs:
        if k < L and T >= 1:
            merged[k, T, h] = merged.get((k, T, h), 0.0) + x
    return [(k, T, x, h) for (k, T, h), x in merged.items() if x]


def inner_held(pairs: Sequence[Pair], a: int, e: int, recompute: Iterable[int] = ()) -> float:
    """inner(a, e) (module docstring) of a stage that is not whole, recomputing `recompute`."""
    redo = set(recompute)
    return float(sum(x for k, source, x, holder in pairs if a <= source and k < e and holder not in redo))


def inner_rows(pairs: Sequence[Pair], starts: np.ndarray, cuts: int) -> np.ndarray:
    """inner(a, e) for a in `starts` (rows) and e = 0 .. cuts - 1 (columns), no unit recomputed; cells with
    e <= a hold any value."""
    out = np.zeros((len(starts), cuts))
    for k, source, x, _ in pairs:
        out[np.ix_(starts <= source, np.arange(k + 1, cuts))] += x
    return out
