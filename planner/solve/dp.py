"""Fast plans from the fill-drain approximation (v = 1, no tied weights): the solver's starting points.

The fill-drain form sum_g T_g + (m - 1) max_g T_g (T_g: stage g's forward, backward and transfers)
is what 1F1B and GPipe take when one stage dominates; planner.solve.chain minimises it exactly and
fast. Its optimum is simulated (planner.cost.model) and improved under the exact model by
planner.solve.exact; it is never reported as optimal by itself. `recompute_for` picks the cheapest
recomputation that makes a split fit (a per-stage knapsack over the units' saved bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from planner.cost.model import evaluate, held_counts, rank_caps, rank_speeds, shared_parameters
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.solve.chain import solve_chain
from planner.solve.chain_recompute import MAX_UNITS, recompute_tables
from planner.solve.solution import Split
from planner.solve.tables import cheapest_recompute

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
        if cap is None or plain.device_memory[c] <= cap:
            continue
        found = cheapest_recompute(profile, b, st.first_unit, st.end_unit, plain.device_memory[c] - cap, held[c],
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
    capped = any(cap is not None for cap in rank_caps(opts, profile))
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
