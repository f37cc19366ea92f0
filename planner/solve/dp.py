"""Fast plans from the fill-drain approximation (v = 1, no tied weights): the solver's starting points.

The fill-drain form sum_g T_g + (m - 1) max_g T_g (T_g: stage g's forward, backward and transfers)
is what 1F1B and GPipe take when one stage dominates; planner.solve.chain minimises it exactly and
fast. Its optimum is simulated (planner.cost.model) and improved under the exact model by
planner.solve.exact; it is never reported as optimal by itself.
"""
from __future__ import annotations

from typing import Optional

from planner.cost.model import evaluate, rank_caps, shared_parameters
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.solve.chain import solve_chain
from planner.solve.chain_recompute import MAX_UNITS, recompute_tables
from planner.solve.solution import Candidate
from planner.solve.recompute import recompute_for

def chain_start(profile: Profile, b: int, opts: CostOptions, deadline: Optional[float] = None) -> Optional[Candidate]:
    """The fill-drain optimum of a v = 1 scenario without tied parameters, simulated: a start for
    the exact search (None when out of scope or nothing fits).

    Recomputation 'none'/'all', or 'auto' without caps: the chain optimum under the caps. 'auto'
    with caps: up to chain_recompute.MAX_UNITS units, the chain optimum with greedy whole-unit
    recomputation per range (planner.solve.chain_recompute); beyond, the uncapped optimum with the
    cheapest recomputation that makes it fit. Past `deadline` (time.perf_counter()) the chain search
    gives the best split it has.
    """
    if opts.virtual_stages != 1 or shared_parameters(profile):
        return None
    auto = opts.recompute == "auto" and any(cap is not None for cap in rank_caps(opts, profile))
    if not auto:
        found = solve_chain(profile, b, opts, deadline=deadline)
        redo = list(range(profile.num_units)) if opts.recompute == "all" else []
    else:
        upper = recompute_tables(profile, b, opts)[1] if profile.num_units <= MAX_UNITS else None
        found = solve_chain(profile, b, opts, caps=False, added=upper, deadline=deadline)
        redo = recompute_for(profile, found.boundaries, b, opts, exact=False) if found is not None else None
    if found is None or redo is None:
        return None
    cost = evaluate(profile, found.boundaries, b, opts, redo)
    return Candidate(cost.iteration_s, list(found.boundaries), redo) if cost.feasible else None
