"""Solving the same problem both ways: the branch and bound (where it applies) and the integer program."""
from __future__ import annotations

import math
from unittest import mock

from planner.solve.api import solve
from planner.solve.brute import solve_brute


def program_only():
    """The integer program settles every scenario: without this, scenarios the branch and bound
    applies to never build it (planner.solve.exact)."""
    return mock.patch("planner.solve.exact.applies", lambda *args: False)


def both_solvers_match_brute_force(profile, opts) -> None:
    """The branch and bound and the integer program both prove brute force's optimum."""
    oracle = solve_brute(profile, opts)
    for program in (False, True):
        with program_only() if program else mock.MagicMock():
            found = solve(profile, opts)
        assert found.status == "optimal", (opts.schedule, program)
        assert math.isclose(found.objective, oracle.objective, rel_tol=1e-9), (opts.schedule, program)
