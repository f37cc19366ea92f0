"""Which stage each unit can sit in, for any split better than an incumbent: the solver's fixings.

A critical-path form k (planner.pipeline.stepgraph) bounds the step time of every split from below:

    step >= sum_g (alpha_kg F_g + beta_kg B_g) + (terms >= 0)

With mu_kg = min(alpha_kg, beta_kg) and W(a, e) = F(a, e) + B(a, e) the stage's work, a split with
step < U must give each stage g = [a, e), for every form k,

    alpha_kg F(a, e) + beta_kg B(a, e) + mu_before W(0, a) / sigma_max + mu_after W(e, L) / sigma_max < U

(mu_before = min_{j<g} mu_kj, mu_after = min_{j>g} mu_kj: the units before g are in stages j < g, each
counted at least mu_before times), and fit its memory with the most recomputation that could help.
`ok[g][a, e]` holds these per-stage conditions. A split is possible only through stages that are ok
and chain from 0 to L, so a forward pass (units [0, a) can fill stages 0..g-1) and a backward pass
([e, L) can fill g+1..S-1) give each unit the range of stages it can still be in: the staircase
variables outside it are fixed. An empty range for some unit proves that no split beats U.
"""
from __future__ import annotations

from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from planner.cost.ranges import RangeCosts
from planner.solve.floors import check_deadline


def stage_conditions(costs: RangeCosts, num_stages: int, speeds: Sequence[float], forms: Iterable[Mapping],
                     bound: float, recompute_all: bool = False,
                     memory: Optional[Tuple[Sequence[Optional[float]], Sequence[int], np.ndarray, np.ndarray]] = None,
                     within: Optional[Sequence[np.ndarray]] = None,
                     deadline: Optional[float] = None) -> List[np.ndarray]:
    """ok[g][a, e]: stage g may hold units [a, e) in a split whose step time is below `bound`.

    speeds[g]: the speed of stage g's rank; memory: (cap per stage, micro-batches held per stage,
    prefix sums of the units' static parameter bytes, the least bytes each range [a, e] can hold for backward
    per micro-batch: planner.solve.exact.least_saved) or None;
    within[g]: only these ranges are tested (the rest are not ok) -- the ranges a caller already knows to
    be the only candidates, as a search whose bound only falls and whose forms only grow does.
    OutOfTime past `deadline` (time.perf_counter(), checked per stage and condition: O(L^2) each)."""
    S = num_stages
    fastest = max(speeds)
    work = (costs.F + costs.G) / fastest
    redo = costs.AGAIN if recompute_all else 0.0
    limit = bound * (1 + 1e-9) + 1e-15
    valid = np.isfinite(costs.matrix(costs.F))
    ok = [valid.copy() if within is None else valid & within[g] for g in range(S)]
    for g, conditions in enumerate(_stage_coefficients(forms, S)):
        if not conditions:
            continue
        a, e = np.nonzero(ok[g])  # tested where still possible: a band of a large profile's ranges
        forward = costs.F[e] - costs.F[a] + costs.call_forward
        backward = (costs.G + redo)[e] - (costs.G + redo)[a] + costs.call_backward
        keep = np.ones(a.size, dtype=bool)
        for alpha, beta, before, after in conditions:
            check_deadline(deadline)
            value = ((alpha * forward if alpha else 0.0) + (beta * backward if beta else 0.0)) / speeds[g]
            if before:
                value = value + before * work[a]  # W(0, a)
            if after:
                value = value + after * (work[-1] - work[e])  # W(e, L)
            keep &= value <= limit
        ok[g][a[~keep], e[~keep]] = False
    if memory is not None:
        caps, held, static_prefix, least = memory
        params = costs.matrix(static_prefix)
        for g in range(S):
            check_deadline(deadline)
            if caps[g] is not None:
                ok[g] &= params + held[g] * least <= caps[g] * (1 + 1e-12)
    return ok


def _stage_coefficients(forms: Iterable[Mapping], S: int) -> List[List[Tuple[int, int, int, int]]]:
    """Per stage, the forms' distinct (alpha, beta, mu_before, mu_after), without those another one
    covers (larger or equal in every coefficient gives the stronger condition): what is left to test."""
    per_stage: List[set] = [set() for _ in range(S)]
    for form in forms:
        alpha = [form.get(("forward", g), 0) for g in range(S)]
        beta = [form.get(("backward", g), 0) for g in range(S)]
        mu = [min(x, y) for x, y in zip(alpha, beta)]
        for g in range(S):
            if alpha[g] or beta[g]:
                per_stage[g].add((alpha[g], beta[g], min(mu[:g]) if g > 0 else 0,
                                  min(mu[g + 1:]) if g < S - 1 else 0))
    out = []
    for found in per_stage:
        kept = [c for c in found
                if not any(o != c and all(x >= y for x, y in zip(o, c)) for o in found)]
        out.append(sorted(kept))
    return out


def unit_ranges(ok: Sequence[np.ndarray]) -> Optional[Tuple[List[int], List[int]]]:
    """(lowest, highest) stage of each unit over the splits made of ok stages; None if there is none."""
    S = len(ok)
    L = ok[0].shape[0] - 1
    start = np.zeros(L + 1, dtype=bool)
    start[0] = True
    reach_end = []  # reach_end[g][e]: units [0, e) fill stages 0..g
    current = start
    for g in range(S):
        current = (current[:, None] & ok[g]).any(axis=0)
        reach_end.append(current)
    finish = np.zeros(L + 1, dtype=bool)
    finish[L] = True
    reach_start = [None] * S  # reach_start[g][a]: units [a, L) fill stages g..S-1
    current = finish
    for g in range(S - 1, -1, -1):
        current = (ok[g] & current[None, :]).any(axis=1)
        reach_start[g] = current
    if not reach_start[0][0]:
        return None
    low, high = [S] * L, [-1] * L
    for g in range(S):
        before = start if g == 0 else reach_end[g - 1]
        after = finish if g == S - 1 else reach_start[g + 1]
        feasible = ok[g] & before[:, None] & after[None, :]
        starts, ends = np.nonzero(feasible)
        if starts.size == 0:
            continue
        cover = np.zeros(L + 1, dtype=int)
        np.add.at(cover, starts, 1)
        np.add.at(cover, ends, -1)
        for l in np.nonzero(np.cumsum(cover)[:L] > 0)[0]:
            low[l], high[l] = min(low[l], g), max(high[l], g)
    return low, high
