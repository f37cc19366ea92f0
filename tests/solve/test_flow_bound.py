"""The step graph's linear relaxation (planner/solve/flow_bound.py) against every split of small random
chains under every schedule: its flow's form lies below each split's simulated step, its least split
is the LP's value (the split's matrix is totally unimodular), and the LP is below the best split."""
import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.cost.model import candidate_micro_batch_sizes, compute_profile, evaluate
from planner.cost.options import CostOptions
from planner.solve.flow_bound import FlowTimes, end_windows, flow_form, separable
from planner.solve.forms import STAGE_TERMS, StageTerms
from tests.support.synthetic import drawn_chain, random_chain

pytest.importorskip("highspy")
LP_TOL = 1e-5  # the LP's value is the interior point method's (no crossover); the form is exact


@st.composite
def chains(draw):
    L = draw(st.integers(3, 9))
    profile = drawn_chain(draw, L)
    schedule, v = draw(st.sampled_from([("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2),
                                        ("interleaved", 3), ("bfs", 2), ("zb-v", 2)]))
    p = draw(st.integers(1, max(1, min(3, L // v))))
    d = draw(st.sampled_from([1, 1, 2]))
    opts = CostOptions(pipeline_ranks=p, global_batch=d * 2 * p * draw(st.sampled_from([1, 2, 4])),
                       schedule=schedule, virtual_stages=v, data_parallel=d,
                       bandwidth=draw(st.sampled_from([2e5, 1e6, 1e8])), latency=draw(st.sampled_from([0.0, 5e-5])),
                       message_s=draw(st.sampled_from([0.0, 2e-5])), optimizer=draw(st.sampled_from(["sgd", "adamw"])),
                       recompute=draw(st.sampled_from(["none", "all"])))
    return profile, opts


def _scenario(problem, largest: bool):
    """(compute profile, options, micro-batch size: the largest or the least the scenario allows, its
    stage terms); a draw without a size or with more stages than units is rejected."""
    profile, opts = problem
    profile = compute_profile(profile, opts)
    sizes = candidate_micro_batch_sizes(profile, opts.global_batch, opts)
    assume(sizes and opts.num_stages <= profile.num_units)
    b = sizes[-1] if largest else sizes[0]
    return profile, opts, b, StageTerms(profile, b, opts)


def _form_value(flow, terms, ends):
    total, a = flow.constant, 0
    for g, e in enumerate(ends):
        total += float(flow.per_stage[g] @ terms.rows[g][:, a, e])
        a = e
    return total


def _separable_everywhere(terms, S):
    return all(separable(terms.rows[g][t], g, S) is not None for g in range(S) for t in range(terms.rows[g].shape[0])
               if terms.rows[g][t].any())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_the_flow_form_lies_below_every_split_and_its_least_is_the_lp(problem):
    profile, opts, b, terms = _scenario(problem, largest=True)
    L, S = profile.num_units, opts.num_stages
    flow = flow_form(terms.rows, terms.ranks, opts, b, opts.message_s)
    assert flow is not None
    assert np.all(flow.per_stage >= 0) and flow.constant >= 0
    redo = list(range(L)) if opts.recompute == "all" else []
    least, best = math.inf, math.inf
    for cuts in itertools.combinations(range(1, L), S - 1):
        step = evaluate(profile, list(cuts), b, opts, redo).iteration_s - opts.step_overhead_s
        value = _form_value(flow, terms, cuts + (L,))
        assert value <= step * (1 + 1e-9) + 1e-12  # a combination of paths: below the split's longest
        least, best = min(least, value), min(best, step)
    assert flow.lp_s <= best * (1 + LP_TOL) + 1e-12
    # the form charges every term at its true value, the LP only the separable ones: equal where all are
    assert least >= flow.lp_s * (1 - LP_TOL) - 1e-12
    if _separable_everywhere(terms, S):
        assert least <= flow.lp_s * (1 + LP_TOL) + 1e-12


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.randoms(use_true_random=False))
def test_a_window_of_ends_sharpens_the_lp_and_the_form_still_holds_everywhere(problem, rng):
    """The LP over the splits whose stages end in given windows (the search's ranges for its target)
    is at least the LP over all, and its form a bound of every split, those outside too."""
    profile, opts, b, terms = _scenario(problem, largest=False)
    L, S = profile.num_units, opts.num_stages
    assume(S >= 2)
    split = sorted(rng.sample(range(1, L), S - 1)) + [L]
    allowed = []
    for g in range(S):  # stage g may end within one unit of the chosen split's end
        mask = np.zeros((L + 1, L + 1), dtype=bool)
        for a in range(L + 1):
            for e in range(a + 1, L + 1):
                mask[a, e] = abs(e - split[g]) <= 1
        allowed.append(mask)
    whole = flow_form(terms.rows, terms.ranks, opts, b, opts.message_s)
    narrow = flow_form(terms.rows, terms.ranks, opts, b, opts.message_s, allowed=allowed)
    assert whole is not None and narrow is not None
    assert narrow.lp_s >= whole.lp_s * (1 - LP_TOL) - 1e-12
    redo = list(range(L)) if opts.recompute == "all" else []
    for cuts in itertools.combinations(range(1, L), S - 1):
        step = evaluate(profile, list(cuts), b, opts, redo).iteration_s - opts.step_overhead_s
        assert _form_value(narrow, terms, cuts + (L,)) <= step * (1 + 1e-9) + 1e-12
    inside = [tuple(c) for c in itertools.combinations(range(1, L), S - 1)
              if all(abs(e - s) <= 1 for e, s in zip(c, split))]
    steps = [evaluate(profile, list(c), b, opts, redo).iteration_s - opts.step_overhead_s for c in inside]
    assert narrow.lp_s <= min(steps) * (1 + LP_TOL) + 1e-12


def test_end_windows_follow_each_other_and_an_empty_one_is_none():
    L, S = 8, 3
    assert end_windows(S, L) == [(1, 6), (2, 7)]
    allowed = [np.zeros((L + 1, L + 1), dtype=bool) for _ in range(S)]
    allowed[0][0, 5] = allowed[0][0, 6] = True  # stage 0 ends at 5 or 6
    allowed[1][5, 6] = allowed[1][3, 6] = True  # stage 1 ends at 6 only
    allowed[2][6, 8] = True
    assert end_windows(S, L, allowed) == [(5, 5), (6, 6)]  # stage 0 must end before stage 1
    allowed[1][:] = False
    assert end_windows(S, L, allowed) is None
    allowed = [np.triu(np.ones((L + 1, L + 1), dtype=bool), 1) for _ in range(S)]
    allowed[0][:, :4] = False  # stage 0 ends at 4 at least: stage 1 at 5
    assert end_windows(S, L, allowed) == [(4, 6), (5, 7)]


def test_separable_reads_a_table_over_the_ranges_its_stage_can_hold():
    rng = np.random.default_rng(0)
    L, S = 7, 3
    A, B = rng.random(L + 1), rng.random(L + 1)
    table = A[:, None] + B[None, :]
    table[np.tril_indices(L + 1)] = 0.0  # not a range
    for g in range(S):
        parts = separable(table, g, S)
        assert parts is not None
        for a, e in ((g, L - S + g + 1), (L - S + g if g else 0, L if g == S - 1 else L - S + g + 1)):
            assert math.isclose(parts[0][a] + parts[1][e], table[a, e])
    table[3, 5] += 1.0  # a range stage 1 can hold (a in 1..5) no longer separable
    assert separable(table, 1, S) is None
    near = A[:, None] + B[None, :]
    near[2, 6] *= 1 + 1e-6  # close, not within the tolerance
    assert separable(near, 1, S) is None
    first = table.copy()
    first[0, 4] += 5.0  # stage 0 always starts at 0: any row 0 is separable
    assert separable(first, 0, S) is not None


def test_a_term_not_separable_is_left_out_of_the_lp_and_the_form_still_holds():
    """A table not of the form A[a] + B[e] (here a stage's forward lowered on one range: the tables
    stay below the durations) is taken as 0 by the LP, which lowers it, and charged at its value by
    the form, which stays below every split's step."""
    rng = random.Random(3)
    L = 8
    opts = CostOptions(pipeline_ranks=2, global_batch=16, schedule="interleaved", virtual_stages=2)
    profile = compute_profile(random_chain(rng, L), opts)
    b, S = 2, opts.num_stages
    terms = StageTerms(profile, b, opts)
    rows = [table.copy() for table in terms.rows]
    forward = STAGE_TERMS.index("forward")
    rows[1][forward, 2, 4] *= 0.5
    assert separable(rows[1][forward], 1, S) is None
    flow = flow_form(rows, terms.ranks, opts, b, opts.message_s)
    whole = flow_form(terms.rows, terms.ranks, opts, b, opts.message_s)
    assert flow.lp_s < whole.lp_s  # without stage 1's forward
    terms.rows = rows
    steps = {cuts: evaluate(profile, list(cuts), b, opts).iteration_s - opts.step_overhead_s
             for cuts in itertools.combinations(range(1, L), S - 1)}
    values = {cuts: _form_value(flow, terms, cuts + (L,)) for cuts in steps}
    assert all(values[c] <= steps[c] * (1 + 1e-9) for c in steps)
    assert min(values.values()) >= flow.lp_s * (1 - LP_TOL)


def test_no_stage_of_the_relaxation_is_empty():
    """Stage 1's forward made a second per unit: a split's stage holds a unit at least, so the LP is at
    least a second (a staircase whose ends may meet would empty the stage and pay nothing)."""
    L = 6
    opts = CostOptions(pipeline_ranks=3, global_batch=6, schedule="1f1b")
    profile = compute_profile(random_chain(random.Random(5), L), opts)
    terms = StageTerms(profile, 2, opts)
    rows = [table.copy() for table in terms.rows]
    units = np.arange(L + 1)
    rows[1][STAGE_TERMS.index("forward")] = np.triu(units[None, :] - units[:, None], 1).astype(float)
    flow = flow_form(rows, terms.ranks, opts, 2, opts.message_s)
    assert flow.lp_s >= 1.0 * (1 - LP_TOL)


def test_a_program_expected_to_overrun_is_not_started():
    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule="interleaved", virtual_stages=2)
    profile = compute_profile(random_chain(random.Random(2), 8), opts)
    terms = StageTerms(profile, 2, opts)
    slow = FlowTimes([(10, 100.0)])  # 100 s for 10 nonzeros, as if measured
    assert flow_form(terms.rows, terms.ranks, opts, 2, 0.0, time_limit=5.0, times=slow) is None
    assert flow_form(terms.rows, terms.ranks, opts, 2, 0.0, times=slow) is not None  # no limit: solved
    times = FlowTimes()
    assert flow_form(terms.rows, terms.ranks, opts, 2, 0.0, time_limit=5.0, times=times) is not None
    assert len(times.solved) == 1 and times.solved[0][0] > 0  # the program joined the solve's record
    assert FlowTimes([(100, 2.0)]).expected_s(200) == 8.0 and FlowTimes([(100, 2.0)]).expected_s(50) == 1.0


def test_a_scenarios_second_search_starts_with_the_first_searchs_form(monkeypatch):
    """The relaxation is solved once per scenario in a solve (planner.solve.branch's `flow`): a later
    search of it takes the form as it is (a bound of every split, whatever windows it was solved over)."""
    import planner.solve.branch as branch

    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule="interleaved", virtual_stages=2)
    profile = compute_profile(random_chain(random.Random(11), 9), opts)
    b = 2
    best = min(evaluate(profile, list(cuts), b, opts, []).iteration_s
               for cuts in itertools.combinations(range(1, 9), opts.num_stages - 1))
    monkeypatch.setattr(branch, "DUAL_AFTER_NODES", 0)  # the dual, then the flow, from the first node
    flow = branch.ScenarioFlow()
    first = branch.branch_and_bound(profile, b, opts, None, set(), time_limit=None, flow=flow)
    assert flow.form is not None and len(flow.times.solved) == 1

    def not_again(*args, **kwargs):
        raise AssertionError("the scenario's relaxation was solved again")

    monkeypatch.setattr(branch, "flow_form", not_again)
    second = branch.branch_and_bound(profile, b, opts, None, set(), time_limit=None, flow=flow)
    for found in (first, second):
        assert found.optimal and math.isclose(found.best.iteration_s, best, rel_tol=1e-9)
        assert found.bound_s <= best * (1 + 1e-9)


def test_solve_scenario_hands_the_scenarios_relaxation_to_its_next_solve(monkeypatch):
    """planner.solve.exact.solve_scenario passes its `flow` to the branch and bound (planner.solve.search keeps
    one per scenario): the second solve of a scenario does not solve its LP again."""
    import planner.solve.branch as branch
    from planner.solve.exact import solve_scenario
    from planner.solve.flow_bound import ScenarioFlow

    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule="interleaved", virtual_stages=2)
    profile = compute_profile(random_chain(random.Random(11), 9), opts)
    monkeypatch.setattr(branch, "DUAL_AFTER_NODES", 0)
    calls = []
    real = branch.flow_form
    monkeypatch.setattr(branch, "flow_form", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    flow = ScenarioFlow()
    for _ in range(2):
        found = solve_scenario(profile, 2, opts, None, None, "highs", flow=flow)
        assert found.optimal
    assert len(calls) == 1 and flow.form is not None
