"""Solving the same problem both ways: the branch and bound (where it applies) and the integer program."""
from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest

from planner.solve.api import solve
from planner.solve.brute import solve_brute
from planner.solve.diagnose import InfeasibleError


def highs_started_elsewhere() -> None:
    """HiGHS's thread scheduler started by another user of HiGHS in this process, with 2 threads (pulp's
    HiGHS at its default threads does so): planner.solve.backends.refused_to_start."""
    import highspy
    import pulp

    highspy.Highs.resetThreadScheduler(False)  # whatever ran before: the other user starts it
    other = pulp.LpProblem("other", pulp.LpMinimize)
    x = other.add_variable("x", 0, 3, cat=pulp.LpInteger) if hasattr(other, "add_variable") else \
        pulp.LpVariable("x", 0, 3, cat=pulp.LpInteger)
    other += x
    other += x >= 1
    other.solve(pulp.HiGHS(msg=False, threads=2))
    assert x.varValue == 1


def program_only():
    """The integer program settles every scenario: without this, scenarios the branch and bound
    applies to never build it (planner.solve.exact)."""
    return mock.patch("planner.solve.exact.applies", lambda *args, **kwargs: False)


def exact_rows():
    """The integer program never takes for a plan one `evaluate` rejects: without this, the search cuts
    such a plan off and goes on (planner.solve.ilp.Program.exclude), which hides a term its rows miss."""
    def refuse(program, boundaries, recompute):
        raise AssertionError(f"the program's rows took split {list(boundaries)} recomputing {list(recompute)} "
                             "for a plan that fits; evaluate says it does not")
    return mock.patch("planner.solve.ilp.Program.exclude", refuse)


def both_solvers_match_brute_force(profile, opts, ways=("search", "program")):
    """Each way of solving (the search as it runs, the branch and bound where it applies; the integer
    program alone, its rows exact: `exact_rows`) proves brute force's optimum, or says infeasible where
    brute force finds no plan. (brute force's solution, the last way's) or (None, None)."""
    oracle, found = solve_brute(profile, opts), None
    for way in ways:
        with program_only() if way == "program" else contextlib.nullcontext(), exact_rows():
            if oracle is None:
                with pytest.raises(InfeasibleError):
                    solve(profile, opts)
                continue
            found = solve(profile, opts)
        assert found.status == "optimal", (opts.schedule, way)
        assert math.isclose(found.objective, oracle.objective, rel_tol=1e-9), (opts.schedule, way)
    return oracle, found
