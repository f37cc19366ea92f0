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


def ticking_clock():
    """The search's clock as a counter (each read one tick), so a search with time_limit=n stops after a few
    nodes; the tables' clock (planner.solve.floors) stands still: on the real one their deadline, a few ticks,
    has long passed and every search would stop before its first node. A context manager."""
    import itertools
    from types import SimpleNamespace

    from planner.solve import branch, floors

    clock = itertools.count()
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(branch, "time", SimpleNamespace(perf_counter=lambda: float(next(clock)))))
    stack.enter_context(mock.patch.object(floors, "time", SimpleNamespace(perf_counter=lambda: 0.0)))
    return stack


def stopped_searches(profile, opts, ticks, best_of):
    """The branch and bound of every micro-batch size of (profile, opts), stopped after `ticks` clock reads
    (`ticking_clock`; None: run to the end), each checked against `best_of(profile, b, opts)`, the best plan
    over every split (+inf: none): a bound never above it, an incumbent never below it. Yields (found, best)."""
    from planner.cost.model import candidate_micro_batch_sizes, compute_profile
    from planner.solve.branch import branch_and_bound

    profile = compute_profile(profile, opts)
    for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
        with ticking_clock():
            found = branch_and_bound(profile, b, opts, None, set(), time_limit=ticks)
        best = best_of(profile, b, opts)
        assert found.bound_s <= best * (1 + 1e-9) or math.isinf(best)
        if found.best is not None:
            assert found.best.iteration_s >= best * (1 - 1e-9)
        yield found, best
