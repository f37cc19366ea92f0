"""Solving with local SGD: the plan and its model averaging period H in 1..H_max
(planner.cost.localsgd's rule).

The split depends on what a step charges for the data-parallel exchange, and the rule chooses H
from a split's averaging time and compute, so the two are found in turn: the plan is solved with
the averaging charged at H_max (the least any H charges), H is chosen for that plan, and when H is
smaller the plan is solved again at that H, on the scenario (p, d, schedule) the first solve chose.
The plan's prediction and certificate are those of the last solve, at its H.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from planner.cost.localsgd import choose_sync_every
from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.solve.solution import Solution

# solve(options, scenario): the best plan for these options; scenario True: on options' own p, d,
# schedule and v alone (not choosing among --devices' splits or several schedules)
Solver = Callable[[CostOptions, bool], Solution]


def solve_local_sgd(profile: Profile, opts: CostOptions, h_max: int, tolerance: float, solve: Solver) -> Solution:
    """The best plan with H chosen in 1..h_max; `opts.sync_every` is ignored. A plan with one
    replica has H = 1 (nothing to average)."""
    if h_max < 1:
        raise ValueError(f"--local-sgd-max must be at least 1 (got {h_max})")
    first = solve(opts.with_(sync_every=h_max), False)
    chosen = first.options  # every solver states the options it solved
    if h_max == 1 or chosen.data_parallel == 1:
        return _with_options(first, chosen.with_(sync_every=1))
    sync_every = choose_sync_every(averaging_s(first), compute_s(profile, first, chosen), h_max, tolerance)
    if sync_every == h_max:
        return first
    return solve(chosen.with_(sync_every=sync_every), True)


def averaging_s(solution: Solution) -> float:
    """A: the slowest rank's whole model averaging in a local-SGD plan (its per-step charge x H)."""
    opts = solution.options
    if opts is None or not opts.local_sgd:
        return 0.0
    reduces = [s for term, s in solution.cost.durations.items() if term[0] == "reduce"]
    return max(reduces, default=0.0) * opts.sync_every


def compute_s(profile: Profile, solution: Solution, opts: CostOptions) -> float:
    """C: the plan's iteration with a free data-parallel exchange (what the replicas compute)."""
    free = opts.with_(dp_bandwidth=float("inf"))
    return evaluate(profile, solution.boundaries, solution.micro_batch_size, free, solution.recompute).iteration_s


def _with_options(solution: Solution, opts: Optional[CostOptions]) -> Solution:
    return dataclasses.replace(solution, options=opts)
