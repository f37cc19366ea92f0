"""The exact chain DP against the ILP (random chains) and against brute force (small chains)."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.solve.api import solve
from planner.solve.brute import solve_brute
from tests.support.synthetic import synthetic_profile


@st.composite
def chains(draw, max_units=14, max_stages=5, with_cap=True):
    L = draw(st.integers(2, max_units))
    S = draw(st.integers(1, min(max_stages, L)))
    sizes = tuple(sorted(draw(st.sets(st.sampled_from((1, 2, 4)), min_size=1, max_size=3))))
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    per = lambda lo, hi: {b: rng.uniform(lo, hi) * (0.5 + b) for b in sizes}
    profile = synthetic_profile([per(1e-3, 1e-2) for _ in range(L)], [per(2e-3, 2e-2) for _ in range(L)],
                                [rng.randint(0, 8 << 20) for _ in range(L)], [rng.randint(0, 4 << 20) for _ in range(L)],
                                [rng.randint(0, 2 << 20) for _ in range(L - 1)], sizes=sizes,
                                stage_overhead={b: (rng.uniform(0, 2e-3), rng.uniform(0, 3e-3)) for b in sizes}
                                if rng.random() < 0.5 else None)
    opts = CostOptions(pipeline_ranks=S, global_batch=draw(st.sampled_from([4, 8, 16])),
                       schedule=draw(st.sampled_from(["1f1b", "gpipe"])), bandwidth=rng.choice([1e8, 1e9, 1e10]),
                       latency=rng.choice([0.0, 1e-4]), optimizer_step_total_s=rng.choice([0.0, 3e-3]))
    if with_cap and draw(st.booleans()):
        free = solve(profile, opts, method="dp")
        peak = max(free.cost.device_memory)
        opts = opts.with_(memory_cap=peak * draw(st.floats(0.6, 1.0)))
    return profile, opts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_ilp_equals_dp(problem):
    profile, opts = problem
    try:
        dp = solve(profile, opts, method="dp")
    except Exception as e:  # infeasible for both or neither
        with pytest.raises(type(e)):
            solve(profile, opts, method="ilp", warm_start=False)
        return
    ilp = solve(profile, opts, method="ilp", warm_start=False)  # the integer program on its own
    assert ilp.objective == pytest.approx(dp.objective, rel=1e-6)
    assert ilp.status == "optimal" and dp.status == "optimal"
    default = solve(profile, opts)  # the search: chain solver where exact, ILP otherwise
    assert default.objective == pytest.approx(dp.objective, rel=1e-6) and default.gap == 0.0
    cost = evaluate(profile, dp.boundaries, dp.micro_batch_size, opts, dp.recompute)
    assert cost.feasible and cost.iteration_s == pytest.approx(dp.objective, rel=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(max_units=7, max_stages=4), st.sampled_from(["none", "all", "auto"]), st.sampled_from([1, 2]))
def test_dp_equals_brute_force(problem, recompute, replicas):
    profile, opts = problem
    opts = opts.with_(recompute=recompute, data_parallel=replicas)
    oracle = solve_brute(profile, opts)
    if oracle is None:
        with pytest.raises(Exception):
            solve(profile, opts, method="dp")
        return
    found = solve(profile, opts, method="dp")
    assert found.objective == pytest.approx(oracle.objective, rel=1e-9)


def test_dp_refuses_what_it_does_not_model():
    p = synthetic_profile([0.01] * 4, [0.02] * 4, [1] * 4, [1] * 4, [1] * 3)
    with pytest.raises(ValueError, match="ilp"):
        solve(p, CostOptions(pipeline_ranks=2, global_batch=8, schedule="interleaved", virtual_stages=2), method="dp")
