"""The outer search: every scenario (pipeline depth p, data-parallel d, schedule, v, micro-batch b),
each solved by the chosen method, with the global certificate.

The decisions that change the shape of the program (p, d, schedule, v, b) are enumerated; the
boundaries and recomputation are solved inside each scenario. A scenario whose lower bound

    LB = G / v + (m - 1/v) D_lb      (G: total compute over the fastest rank, or the unconstrained
                                      min-sum DP when v = 1; D_lb: exact min-max stage time
                                                  when v = 1, else max(W / (p sigma_max), max_l w_l))

is not below the incumbent is skipped; the global bound is the minimum over scenarios of their
proven bounds (a skipped scenario contributes its LB), so the reported gap is a true gap.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from planner.cost.model import (candidate_micro_batch_sizes, evaluate, num_micro_batches, rank_speeds,
                                shared_parameters, stage_call_s)
from planner.cost.options import CostOptions
from planner.pipeline.schedule import MULTI_STAGE_SCHEDULES
from planner.profile.profile import Profile
from planner.solve.diagnose import min_max_partition
from planner.solve.dp import _min_sum, chain_bounds, dp_for_size
from planner.solve.ilp import build_and_solve
from planner.solve.solution import OPTIMALITY_GAP, Solution, Split
from planner.solve.tables import stage_tables

def expand_scenarios(opts: CostOptions, num_units: int, devices: Optional[int] = None,
                     schedules: Optional[Sequence[str]] = None, virtual_stages: Optional[int] = None
                     ) -> List[CostOptions]:
    """Concrete options: each schedule (interleaved/bfs with v = virtual_stages, default the
    options' own or 2) and, given `devices` N, each p x d = N."""
    multi_v = virtual_stages if virtual_stages is not None else max(2, opts.virtual_stages)
    schedules = list(schedules) if schedules else [opts.schedule]
    pairs = [(opts.pipeline_ranks, opts.data_parallel)] if devices is None else \
        [(devices // d, d) for d in range(1, devices + 1) if devices % d == 0 and opts.global_batch % d == 0]
    out = []
    for p, d in pairs:
        for schedule in schedules:
            v = multi_v if schedule in MULTI_STAGE_SCHEDULES else 1
            if p * v <= num_units:
                out.append(opts.with_(pipeline_ranks=p, data_parallel=d, schedule=schedule, virtual_stages=v))
    return out


@dataclass
class _Candidate:
    opts: CostOptions
    b: int
    heuristic: Optional[Split]
    lower_bound: float
    floor: float  # D_lb (s)
    total: float  # lower bound on sum_c T_c (s)
    exact: bool = False  # heuristic is proven optimal for this (scenario, b): no ILP needed


def _balanced_split(profile: Profile, b: int, opts: CostOptions) -> List[int]:
    work = np.concatenate([[0.0], np.cumsum([u.forward_s[b] + u.backward_s[b] for u in profile.units])])
    n = len(work)
    table = np.where(np.triu(np.ones((n, n), dtype=bool), 1), work[None, :] - work[:, None], np.inf)
    return min_max_partition(profile.num_units, opts.num_stages, lambda c: table)[1]


def heuristic_plan(profile: Profile, b: int, opts: CostOptions) -> Optional[Split]:
    """A good feasible plan fast: the chain solver's (v = 1), else a balanced split."""
    if opts.virtual_stages == 1 and not shared_parameters(profile):
        fast = chain_bounds(profile, b, opts)
        if fast is not None:
            return fast.plan
    bounds = _balanced_split(profile, b, opts)
    for redo in ([], [l for l in range(profile.num_units)]) if opts.recompute == "auto" else \
            ([list(range(profile.num_units))] if opts.recompute == "all" else [[]]):
        cost = evaluate(profile, bounds, b, opts, redo)
        if cost.feasible:
            return Split(cost.iteration_s, bounds, redo)
    return None


def _candidate(profile: Profile, opts: CostOptions, b: int, use_heuristic: bool) -> _Candidate:
    m, v, p = num_micro_batches(opts, b), opts.virtual_stages, opts.pipeline_ranks
    fastest = max(rank_speeds(opts))
    w = [(u.forward_s[b] + u.backward_s[b]) / fastest for u in profile.units]
    call = stage_call_s(profile, b) / fastest  # every one of the C stages pays it
    total = sum(w) + opts.num_stages * call
    floor = max(total / p, max(w) + v * call)  # the rank holding the largest unit runs v stages
    if use_heuristic and v == 1:
        fast = chain_bounds(profile, b, opts)
        if fast is not None:  # exact, or bounds and an incumbent for the ILP
            floor, total = max(floor, fast.floor), max(total, fast.total)
            lower = fast.plan.iteration_s if fast.exact and fast.plan is not None else \
                max(fast.lower_bound, total + (m - 1) * floor + opts.per_step_s)
            return _Candidate(opts, b, fast.plan, lower, floor, total, exact=fast.exact)
    if v == 1:
        tables = stage_tables(profile, b, opts.with_(recompute="none"))
        floor = max(floor, min_max_partition(profile.num_units, opts.num_stages, lambda c: tables.time[c])[0])
        total = max(total, _min_sum(tables.time, profile.num_units)[0])  # sum_c T_c >= g_min
    lower = total / v + (m - 1.0 / v) * floor + opts.per_step_s
    heuristic = heuristic_plan(profile, b, opts) if use_heuristic else None
    return _Candidate(opts, b, heuristic, lower, floor, total)


def _candidates(profile: Profile, scenarios: List[CostOptions], use_heuristic: bool) -> List[_Candidate]:
    return [_candidate(profile, opts, b, use_heuristic) for opts in scenarios
            for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts)]


@dataclass
class _Best:
    """The best plan found so far: its split, micro-batch size and scenario."""

    split: Split
    b: int
    opts: CostOptions


def search_scenarios(profile: Profile, scenarios: List[CostOptions], method: str, time_limit: Optional[float] = None,
                     backend: str = "cbc", warm_start: bool = True) -> Optional[Solution]:
    """Best plan over the scenarios by `method` ('ilp' or 'dp'); None when nothing fits."""
    started = time.perf_counter()
    if method == "dp":
        best = _best_by_dp(profile, scenarios)
        return None if best is None else _solution(profile, best, best.split.iteration_s, True, started, "dp", "python")
    candidates = sorted(_candidates(profile, scenarios, warm_start),
                        key=lambda c: (c.heuristic.iteration_s if c.heuristic else math.inf, c.lower_bound))
    best: Optional[_Best] = None
    for c in candidates:
        if c.heuristic and (best is None or c.heuristic.iteration_s < best.split.iteration_s):
            best = _Best(c.heuristic, c.b, c.opts)
    bound, all_optimal, ran_ilp = math.inf, True, False
    for c in candidates:
        if c.exact or (best is not None and c.lower_bound >= best.split.iteration_s * (1 - 1e-12)):
            bound = min(bound, c.lower_bound)
            continue
        remaining = None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - started))
        incumbent = _incumbent(profile, c, best) if warm_start and best is not None else None
        ran_ilp = True
        result = build_and_solve(profile, c.b, c.opts, incumbent, c.floor, c.total, remaining, backend, warm_start)
        all_optimal = all_optimal and result.optimal
        if result.boundaries is not None:
            try:
                cost = evaluate(profile, result.boundaries, c.b, c.opts, result.recompute)
            except ValueError:
                cost = None
            if cost is not None and cost.feasible and (best is None or cost.iteration_s < best.split.iteration_s):
                best = _Best(Split(cost.iteration_s, result.boundaries, result.recompute), c.b, c.opts)
        bound = min(bound, max(result.bound_s, c.lower_bound))
    if best is None:
        return None
    if not ran_ilp:  # every scenario was settled by the exact chain solver or its bound
        return _solution(profile, best, bound, True, started, "dp", "python")
    return _solution(profile, best, bound, all_optimal, started, "ilp", backend)


def _best_by_dp(profile: Profile, scenarios: List[CostOptions]) -> Optional[_Best]:
    best: Optional[_Best] = None
    for opts in scenarios:
        for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
            found = dp_for_size(profile, b, opts)
            if found is not None and (best is None or found.iteration_s < best.split.iteration_s):
                best = _Best(found, b, opts)
    return best


def _incumbent(profile: Profile, c: _Candidate, best: _Best) -> Split:
    """What a scenario's program starts from: the best value so far, and as the warm start this
    scenario's own heuristic split (a balanced split when it has none of its shape)."""
    h = c.heuristic
    if h is None or len(h.boundaries) != c.opts.num_stages - 1:
        return Split(best.split.iteration_s, _balanced_split(profile, c.b, c.opts), [])
    return Split(best.split.iteration_s, h.boundaries, h.recompute)


def _solution(profile: Profile, best: _Best, bound: float, solver_optimal: bool, started: float, method: str,
              backend: str) -> Solution:
    iteration, boundaries, redo, b, opts = (best.split.iteration_s, best.split.boundaries, best.split.recompute,
                                            best.b, best.opts)
    cost = evaluate(profile, boundaries, b, opts, redo)
    bound = min(bound, iteration)
    gap = max(0.0, (iteration - bound) / iteration) if iteration > 0 else 0.0
    if solver_optimal and gap <= OPTIMALITY_GAP:
        bound, gap = iteration, 0.0
    status = "optimal" if gap <= OPTIMALITY_GAP else "feasible"
    return Solution(boundaries=list(boundaries), micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                    cost=cost, status=status, objective=iteration, bound=bound, gap=gap,
                    seconds=time.perf_counter() - started, method=method, backend=backend,
                    recompute=list(redo), options=opts)
