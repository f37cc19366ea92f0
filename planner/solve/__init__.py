"""Solvers for the pipeline plan: an integer program (proven optimal) and a brute-force oracle."""
from __future__ import annotations

from typing import Optional

from planner.costmodel import CostOptions
from planner.profile import Profile
from planner.solve.brute import solve_brute
from planner.solve.diagnose import InfeasibleError, diagnose, format_bytes, infeasible_error, min_memory_plan
from planner.solve.ilp import Solution, solve_ilp

METHODS = ("ilp", "brute")


def solve(profile: Profile, opts: CostOptions, method: str = "ilp", time_limit: Optional[float] = None,
          backend: str = "cbc") -> Solution:
    """The best plan for (profile, opts) by `method`; raises InfeasibleError when none exists."""
    if method == "ilp":
        return solve_ilp(profile, opts, time_limit=time_limit, backend=backend)
    if method == "brute":
        opts.validate()
        if opts.num_stages > profile.num_units:
            raise infeasible_error(profile, opts)
        solution = solve_brute(profile, opts)
        if solution is None:
            raise infeasible_error(profile, opts)
        return solution
    raise ValueError(f"unknown solve method {method!r}; use one of {', '.join(METHODS)}")


__all__ = ["solve", "solve_ilp", "solve_brute", "Solution", "InfeasibleError", "diagnose",
           "format_bytes", "min_memory_plan", "infeasible_error", "METHODS"]
