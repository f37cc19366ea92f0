"""The exact dynamic program for chains (v = 1 stage per rank, no tied parameters): `--method dp`.

For one micro-batch size b (and fixed p, d, schedule) let T_c(a, e) be the time of units [a, e)
as stage c (cheapest memory-fitting recomputation included, +inf when nothing fits) and E_c(a, e)
its per-iteration all-reduce time (planner.solve.tables). The objective

    min over splits  sum_c T_c + (m - 1) max_c T_c + max_c E_c

is not separable because of the two maxima, so both are fixed by thresholds: for every pair
(tau, eps) of candidate values (values the matrices take),

    g(tau, eps) = min sum_c T_c  subject to  T_c <= tau, E_c <= eps      (min-sum DP:
                  best_c(e) = min_{a<e} best_{c-1}(a) + T_c(a, e), masked)

and the optimum is min over (tau, eps) of g(tau, eps) + (m - 1) tau + eps, evaluated at the split
found (whose own maxima are <= the thresholds). Thresholds are scanned upwards from the min-max
values and stop once (m - 1) tau + eps + g_min >= the incumbent (g_min: the unconstrained min sum),
which is exact because g >= g_min. Memory enters through T_c = +inf.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from planner.cost.model import (evaluate, held_counts, rank_caps, rank_speeds,
                                shared_parameters)
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.solve.chain import solve_chain
from planner.solve.chain_recompute import MAX_UNITS, recompute_tables
from planner.solve.diagnose import min_max_partition
from planner.solve.solution import Split
from planner.solve.tables import auto_recompute_times, cheapest_recompute, stage_tables

def _min_sum(times: List[np.ndarray], L: int) -> Tuple[float, Optional[List[int]]]:
    """min over splits of sum_c times[c][a_c, e_c]; (value, boundaries) or (inf, None)."""
    best = times[0][0, :].copy()
    choices = []
    for t in times[1:]:
        cand = best[:, None] + t
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(L + 1)]
        choices.append(arg)
    if not math.isfinite(best[L]):
        return math.inf, None
    bounds, e = [], L
    for arg in reversed(choices):
        e = int(arg[e])
        bounds.append(e)
    return float(best[L]), sorted(bounds)


def recompute_for(profile: Profile, boundaries: List[int], b: int, opts: CostOptions, exact: bool = True
                  ) -> Optional[List[int]]:
    """The cheapest recomputation set making every stage of this split fit (None: impossible)."""
    L = profile.num_units
    if opts.recompute == "all":
        return list(range(L))
    plain = evaluate(profile, boundaries, b, opts)
    if opts.recompute == "none" or plain.feasible:
        return [] if plain.feasible else None
    if opts.virtual_stages != 1:
        return None
    speeds, held, chosen = rank_speeds(opts), held_counts(opts, plain.num_micro_batches), []
    for c, st in enumerate(plain.stages):
        cap = plain.device_caps[c]
        if cap is None or st.memory_bytes <= cap:
            continue
        found = cheapest_recompute(profile, b, st.first_unit, st.end_unit, st.memory_bytes - cap, held[c],
                                   speeds[c], exact)
        if found is None:
            return None
        chosen += found[1]
    return chosen


@dataclass
class ChainBounds:
    """What the fast chain solver proves about one v = 1 scenario at one micro-batch size."""

    plan: Optional[Split]  # the best plan found (None: nothing fits without recomputation)
    lower_bound: float  # on every plan of the scenario (recomputation included)
    exact: bool  # plan is optimal: no integer program needed
    floor: float  # lower bound on max_c T_c (tau* without caps or recomputation)
    total: float  # lower bound on sum_c T_c


def chain_bounds(profile: Profile, b: int, opts: CostOptions) -> Optional[ChainBounds]:
    """Solve a v = 1 scenario without tied parameters by planner.solve.chain; None if out of scope.

    Recomputation 'none'/'all', or 'auto' without caps: the chain optimum is the scenario optimum.
    'auto' with caps: recomputing only adds forward time and only lowers memory. Up to
    chain_recompute.MAX_UNITS units, the chain optimum with each range's fractional-knapsack
    recomputation time is a lower bound and the one with greedy whole-unit recomputation a plan
    (planner.solve.chain_recompute); beyond, the optimum without caps or recomputation is the
    lower bound and the capped optimum without recomputation the plan. When the two meet, the plan
    is optimal; otherwise the ILP closes the gap.
    """
    if opts.virtual_stages != 1 or shared_parameters(profile):
        return None
    capped = any(cap is not None for cap in rank_caps(opts))
    auto = opts.recompute == "auto" and capped
    redo_all = list(range(profile.num_units)) if opts.recompute == "all" else []
    if not auto:
        found = solve_chain(profile, b, opts)
        if found is None:
            return ChainBounds(None, math.inf, True, math.inf, math.inf)
        cost = evaluate(profile, found.boundaries, b, opts, redo_all)
        plan = Split(cost.iteration_s, list(found.boundaries), redo_all)
        return ChainBounds(plan, found.objective, cost.feasible, found.min_max, found.min_sum)
    if profile.num_units <= MAX_UNITS:
        lower_t, upper_t = recompute_tables(profile, b, opts)
        relaxed = solve_chain(profile, b, opts, caps=False, added=lower_t)
        upper = solve_chain(profile, b, opts, caps=False, added=upper_t)
    else:
        relaxed = solve_chain(profile, b, opts, caps=False)
        upper = solve_chain(profile, b, opts, caps=True)
    if relaxed is None:
        return ChainBounds(None, math.inf, True, math.inf, math.inf)
    best: Optional[Split] = None
    for bounds in [upper.boundaries] if upper is not None else []:
        redo = recompute_for(profile, bounds, b, opts, exact=False)
        cost = evaluate(profile, bounds, b, opts, redo) if redo is not None else None
        if cost is not None and cost.feasible:
            best = Split(cost.iteration_s, list(bounds), redo)
    exact = best is not None and best.iteration_s <= relaxed.objective * (1 + 1e-12)
    return ChainBounds(best, relaxed.objective, exact, relaxed.min_max, relaxed.min_sum)


def dp_for_size(profile: Profile, b: int, opts: CostOptions, exact: bool = True,
                max_thresholds: Optional[int] = None) -> Optional[Split]:
    """The best plan at micro-batch size b, or None when nothing fits.

    Uses the fast chain solver (planner.solve.chain) whenever it is exact; otherwise (recompute
    'auto' with binding caps) the threshold scan below with per-range recomputation knapsacks.
    exact=False uses the greedy recomputation and max_thresholds caps the tau scan (a heuristic for
    warm starts on large profiles); with the defaults the answer is the exact optimum.
    """
    fast = chain_bounds(profile, b, opts)
    if fast is not None and (fast.exact or fast.plan is None and math.isinf(fast.lower_bound)):
        return fast.plan

    L, C = profile.num_units, opts.num_stages
    tables = stage_tables(profile, b, opts)
    if opts.recompute == "auto" and any(cap is not None for cap in tables.caps):
        times = auto_recompute_times(profile, b, opts, tables, exact)
    else:
        times = [np.where(mem <= cap, t, np.inf) if cap is not None else t
                 for t, mem, cap in zip(tables.time, tables.memory, tables.caps)]
    extras = tables.extra
    m = tables.m
    tau_star, split = min_max_partition(L, C, lambda c: times[c])
    if split is None:
        return None
    g_min, _ = _min_sum(times, L)
    eps_values = np.unique(np.concatenate([E[np.isfinite(t)] for E, t in zip(extras, times)])).tolist()
    eps_star, _ = min_max_partition(L, C, lambda c: np.where(np.isfinite(times[c]), extras[c], np.inf))
    eps_values = [x for x in eps_values if x >= eps_star - 1e-15] or [0.0]
    finite = np.concatenate([t[np.isfinite(t) & (t >= tau_star)] for t in times])
    tau_values = np.unique(finite).tolist() if m > 1 else [math.inf]  # m = 1: no max term at all
    best: Optional[Split] = None

    def consider(bounds: List[int]) -> None:
        nonlocal best
        redo = recompute_for(profile, bounds, b, opts, exact)
        if redo is None:
            return
        cost = evaluate(profile, bounds, b, opts, redo)
        if cost.feasible and (best is None or cost.iteration_s < best.iteration_s):
            best = Split(cost.iteration_s, bounds, redo)

    for eps in eps_values:
        if best is not None and g_min + (m - 1) * tau_star + eps + opts.per_step_s >= best.iteration_s:
            break
        masks = [np.where(E <= eps, t, np.inf) for t, E in zip(times, extras)]
        for count, tau in enumerate(tau_values):
            if best is not None and g_min + (m - 1) * tau + eps + opts.per_step_s >= best.iteration_s:
                break
            if max_thresholds is not None and count >= max_thresholds:
                break
            value, bounds = _min_sum([np.where(t <= tau, t, np.inf) for t in masks], L)
            if bounds is not None:
                consider(bounds)
    return best


def check_dp_scope(profile: Profile, opts: CostOptions) -> None:
    """ValueError unless the dp method models these options (one stage per rank, no tied weights)."""
    if opts.virtual_stages != 1:
        raise ValueError("the dp method handles one stage per rank (gpipe/1f1b); use --method ilp for "
                         f"{opts.schedule}")
    if shared_parameters(profile):
        raise ValueError("the dp method does not model tied-parameter exchange; use --method ilp")
