"""The Lagrangian dual of the path forms (planner/solve/dual.py) on random chains with chunked
schedules (v = 2): its bound holds for every split (never above the best one, found by trying every
split) and is never below the old root bound, the best single form's best split."""
import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.cost.model import candidate_micro_batch_sizes, compute_profile, evaluate
from planner.cost.options import CostOptions
from planner.solve.forms import Forms, StageTerms, form_prefix
from planner.solve.dual import Dual
from planner.solve.floors import Band, form_completions
from planner.solve.exact import structural_forms
from tests.support.synthetic import drawn_chain


@st.composite
def chunked_chains(draw):
    L = draw(st.integers(4, 9))
    profile = drawn_chain(draw, L)
    opts = CostOptions(pipeline_ranks=draw(st.integers(2, min(3, L // 2))), global_batch=draw(st.sampled_from([4, 8])),
                       schedule=draw(st.sampled_from(["interleaved", "bfs", "zb-v"])), virtual_stages=2,
                       bandwidth=draw(st.sampled_from([2e5, 1e8])), latency=draw(st.sampled_from([0.0, 5e-5])),
                       message_s=draw(st.sampled_from([0.0, 2e-5])), optimizer="adamw",
                       memory_cap=draw(st.sampled_from([None, None, 12000.0])))
    return profile, opts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked_chains())
def test_the_dual_bound_holds_and_beats_every_single_form(problem):
    profile, opts = problem
    profile = compute_profile(profile, opts)
    sizes = candidate_micro_batch_sizes(profile, opts.global_batch, opts)
    assume(sizes)
    b = sizes[0]
    L, S = profile.num_units, opts.num_stages
    steps = {}
    for cuts in itertools.combinations(range(1, L), S - 1):
        cost = evaluate(profile, list(cuts), b, opts)
        if cost.feasible:
            steps[cuts] = cost.iteration_s - opts.step_overhead_s
    known = Forms(StageTerms(profile, b, opts), opts.message_s)
    for form in structural_forms(profile, b, opts):
        known.add(form)
    single = float((known.constant + known.completion[:, 0, 0]).max(initial=-math.inf))
    met = []

    def found(ends):
        met.append(ends)
        known.add(evaluate(profile, list(ends[:-1]), b, opts).critical_path)

    lam, value = Dual().ascend(known, found, time.perf_counter() + 60, 200)
    if lam is None:  # no form: nothing to weigh
        assert len(known) == 0
        return
    assert np.all(lam >= 0) and math.isclose(lam.sum(), 1.0) and len(lam) == len(known)
    assert value >= single * (1 - 1e-12) - 1e-15
    if steps:
        assert value <= min(steps.values()) * (1 + 1e-9)
    # the value is the combination's least split: the dynamic program agrees with every split
    per_stage = np.einsum("k,gkt->gt", lam, known.coefficients)
    D = form_completions(per_stage[:, None, :], known.terms.band)[0]
    assert math.isclose(float(lam @ known.constant + D[0, 0]), value, rel_tol=1e-9) or not math.isfinite(value)
    for ends in met:  # each split the ascent met is a complete split of the chain
        assert len(ends) == S and ends[-1] == L and all(x < y for x, y in zip((0,) + ends, ends))
    # as the search's synthetic form: at every split that fits, no form (it included) exceeds the step
    known.add_combination(lam)
    for cuts, step in steps.items():
        values = form_prefix(known, slice(0, len(known)), cuts + (L,))
        assert np.all(values <= step * (1 + 1e-9))


def test_the_dynamic_program_finds_the_least_split():
    """form_completions' D and ends against every split of a small random table (two weightings at
    once: each its own least split)."""
    rng = np.random.default_rng(0)
    L, S, T = 7, 3, 2
    rows = [rng.uniform(0, 1, size=(T, L + 1, L + 1)) for _ in range(S)]
    allowed = [np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1) & (rng.uniform(size=(L + 1, L + 1)) < 0.8)
               for _ in range(S)]
    weights = rng.uniform(0, 1, size=(S, 2, T))
    D, ends = form_completions(weights, Band([np.where(np.isfinite(r), r, 0.0) for r in rows], allowed),
                               with_ends=True)
    for k in range(2):
        per_stage = weights[:, k, :]
        best, best_split = math.inf, None
        for cuts in itertools.combinations(range(1, L), S - 1):
            split = cuts + (L,)
            starts = (0,) + cuts
            if all(allowed[g][a, e] for g, (a, e) in enumerate(zip(starts, split))):
                value = sum(per_stage[g] @ rows[g][:, a, e] for g, (a, e) in enumerate(zip(starts, split)))
                if value < best:
                    best, best_split = value, split
        assert math.isclose(D[k, 0, 0], best, rel_tol=1e-12)
        a, followed = 0, []
        for g in range(S):
            a = int(ends[k, g, a])
            followed.append(a)
        assert tuple(followed) == best_split


def test_the_master_solves_after_another_user_of_highs_in_the_process():
    # HiGHS keeps one thread scheduler per process: after pulp's HiGHS at 2 threads, the master's LP at one
    # was refused, and the dual gave no bound at all (planner.solve.backends.refused_to_start)
    from planner.solve.dual import SimplexMaster
    from tests.support.solvers import highs_started_elsewhere

    highs_started_elsewhere()
    master = SimplexMaster()
    for _ in range(2):
        master.add_form(np.zeros(0))
    master.add_split(np.array([1.0, 2.0]))
    master.add_split(np.array([3.0, 0.5]))
    lam, level = master.solve()  # max over lam of min(lam . (1, 2), lam . (3, 0.5)): lam = (3/7, 4/7)
    assert level == pytest.approx(11 / 7) and lam == pytest.approx([3 / 7, 4 / 7])
