"""Exhaustive search: every split and every candidate micro-batch size. The test oracle.

There are C(L-1, S-1) ways to choose S-1 boundaries among the L-1 cuts; each is evaluated with
planner.costmodel.evaluate for every candidate b. The minimum feasible iteration time wins; ties
go to the lexicographically smallest boundaries, then the smallest b.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Optional

from planner.costmodel import CostOptions, candidate_micro_batch_sizes, evaluate
from planner.profile import Profile
from planner.solve.ilp import Solution

MAX_COMBINATIONS = 200_000


def solve_brute(profile: Profile, opts: CostOptions) -> Optional[Solution]:
    """The exact optimum by enumeration, or None when no plan is feasible.

    Raises ValueError when S > L or the search would exceed MAX_COMBINATIONS evaluations.
    """
    opts.validate()
    started = time.perf_counter()
    L, S = profile.num_units, opts.num_stages
    if S > L:
        raise ValueError(f"{S} stages requested but the profile has only {L} units")
    sizes = candidate_micro_batch_sizes(profile, opts.global_batch)
    combinations = math.comb(L - 1, S - 1) * len(sizes)
    if combinations > MAX_COMBINATIONS:
        raise ValueError(f"brute force would evaluate {combinations} plans (limit {MAX_COMBINATIONS}); "
                         "use the ILP solver")
    best = None  # (iteration, boundaries, b, cost)
    for boundaries in itertools.combinations(range(1, L), S - 1):
        for b in sizes:
            cost = evaluate(profile, list(boundaries), b, opts)
            if not cost.feasible:
                continue
            key = (cost.iteration_s, boundaries, b)
            if best is None or key < best[:3]:
                best = (cost.iteration_s, boundaries, b, cost)
    if best is None:
        return None
    iteration, boundaries, b, cost = best
    return Solution(boundaries=list(boundaries), micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                    cost=cost, status="optimal", objective=iteration, bound=iteration, gap=0.0,
                    seconds=time.perf_counter() - started, method="brute", backend="python")
