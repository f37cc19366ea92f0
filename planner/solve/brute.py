"""Exhaustive search: every split, every candidate micro-batch size, every recomputation set. The oracle.

There are C(L-1, C-1) ways to choose the C - 1 boundaries of C = p v stages; each is evaluated
with planner.cost.model.evaluate for every candidate b (and, under --recompute auto with a memory
cap, for every subset of the units that can shrink by recomputation: 2^L more). The minimum
feasible iteration time wins; ties go to the smallest boundaries, then the smallest b.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import List, Optional

import numpy as np

from planner.cost.model import candidate_micro_batch_sizes, evaluate, rank_caps
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.profile.profile import Profile
from planner.solve.chain_recompute import worth_recomputing
from planner.solve.replica_tables import replica_tuples, replicates_running_stats
from planner.solve.solution import Solution

MAX_COMBINATIONS = 200_000


def _shrinkable(profile: Profile, b: int, opts: CostOptions) -> Optional[List[int]]:
    """The units whose recomputation is chosen one by one (--recompute auto under a cap: those whose
    recomputation may free bytes, chain_recompute.worth_recomputing); None when the recomputation is
    fixed (none, all, or no cap)."""
    if opts.recompute == "all" or opts.recompute == "none" or all(cap is None for cap in rank_caps(opts, profile)):
        return None
    return [int(l) for l in np.flatnonzero(worth_recomputing(range_costs(profile, b), opts.schedule))]


def _set_count(shrinkable: Optional[List[int]]) -> int:
    """How many recomputation sets brute force tries, given `_shrinkable`'s units."""
    return 1 if shrinkable is None else 2 ** len(shrinkable)


def _recompute_sets(shrinkable: Optional[List[int]], opts: CostOptions, L: int) -> List[List[int]]:
    """Every recomputation set brute force tries, given `_shrinkable`'s units."""
    if shrinkable is None:
        return [list(range(L))] if opts.recompute == "all" else [[]]
    return [list(s) for r in range(len(shrinkable) + 1) for s in itertools.combinations(shrinkable, r)]


def solve_brute(profile: Profile, opts: CostOptions, limit: int = MAX_COMBINATIONS) -> Optional[Solution]:
    """The exact optimum by enumeration, or None when no plan is feasible.

    Raises ValueError when C > L or the search would exceed `limit` evaluations.
    """
    opts.validate()
    started = time.perf_counter()
    L, C = profile.num_units, opts.num_stages
    if C > L:
        raise ValueError(f"{C} stages requested but the profile has only {L} units")
    sizes = candidate_micro_batch_sizes(profile, opts.global_batch, opts)
    shrinkable = {b: _shrinkable(profile, b, opts) for b in sizes}
    combinations = math.comb(L - 1, C - 1) * sum(_set_count(units) for units in shrinkable.values())
    if combinations > limit:
        raise ValueError(f"brute force would evaluate {combinations} plans (limit {limit}); "
                         "use the ILP solver")
    sets = {b: _recompute_sets(units, opts, L) for b, units in shrinkable.items()}
    best = None  # (iteration, boundaries, b, recompute, cost)
    for boundaries in itertools.combinations(range(1, L), C - 1):
        for b in sizes:
            for redo in sets[b]:
                cost = evaluate(profile, list(boundaries), b, opts, redo)
                if not cost.feasible:
                    continue
                key = (cost.iteration_s, boundaries, b)
                if best is None or key < best[:3]:
                    best = (cost.iteration_s, boundaries, b, redo, cost)
    if best is None:
        return None
    iteration, boundaries, b, redo, cost = best
    return Solution(boundaries=list(boundaries), micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                    cost=cost, status="optimal", objective=iteration, bound=iteration, gap=0.0,
                    seconds=time.perf_counter() - started, method="brute", backend="python",
                    recompute=list(redo), options=opts)


def replicated_plan_count(profile: Profile, opts: CostOptions, limit: float = math.inf) -> int:
    """How many plans `solve_brute_replicated` evaluates (before the running-statistics filter); once
    past `limit`, a number past it (counting the rest takes long: 2^L recomputation sets, the tuples)."""
    L, N, total = profile.num_units, opts.pipeline_ranks, 0
    for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
        m = opts.global_batch // (opts.data_parallel * b)
        sets = _set_count(_shrinkable(profile, b, opts))
        for S in range(1, min(N, L) + 1):
            total += sum(1 for _ in replica_tuples(N, S, m)) * math.comb(L - 1, S - 1) * sets
            if total > limit:  # (the tuples alone grow fast with N)
                return total
    return total


def solve_brute_replicated(profile: Profile, opts: CostOptions, deadline: Optional[float] = None
                           ) -> Optional[Solution]:
    """The oracle for --replicate: every S <= N = opts.pipeline_ranks, split, replica tuple (sum N) and b,
    judged by planner.cost.model.evaluate, with every recomputation set that opts.recompute allows.
    Past `deadline` (time.perf_counter()), once a plan fits, the best so far: status 'feasible' with the
    bound 0 (the caller knows a better one)."""
    started = time.perf_counter()
    L, N = profile.num_units, opts.pipeline_ranks

    def plans():  # (b, options, boundaries, recomputation) of every plan
        for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
            m = opts.global_batch // (opts.data_parallel * b)
            sets = _recompute_sets(_shrinkable(profile, b, opts), opts, L)
            for S in range(1, min(N, L) + 1):
                for reps in replica_tuples(N, S, m):
                    scenario = opts.with_(replicas=reps if max(reps) > 1 else ())  # sum(reps) = N
                    splits = [c for c in itertools.combinations(range(1, L), S - 1)
                              if not replicates_running_stats(profile, list(c), reps)]
                    for boundaries, redo in itertools.product(splits, sets):
                        yield b, scenario, list(boundaries), redo

    best = None  # (iteration, cost, boundaries, b, options, recompute)
    stopped = False
    for b, scenario, boundaries, redo in plans():
        if deadline is not None and best is not None and time.perf_counter() > deadline:
            stopped = True
            break
        cost = evaluate(profile, boundaries, b, scenario, redo)
        if cost.feasible and (best is None or cost.iteration_s < best[0]):
            best = (cost.iteration_s, cost, boundaries, b, scenario, redo)
    if best is None:
        return None
    iteration, cost, boundaries, b, scenario, redo = best
    return Solution(boundaries=boundaries, micro_batch_size=b, num_micro_batches=cost.num_micro_batches, cost=cost,
                    status="feasible" if stopped else "optimal", objective=iteration,
                    bound=0.0 if stopped else iteration, gap=1.0 if stopped else 0.0,
                    seconds=time.perf_counter() - started, method="brute", backend="python", recompute=redo,
                    options=scenario)
