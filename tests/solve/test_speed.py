"""Fast checks of the solver's speed path (the banded chain solver), the step overhead, and the
calibration defaults of `planner solve`."""
import os
import random
import time

import pytest

from planner.cli.main import main
from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.profile.profile import save_profile
from planner.solve.api import solve
from planner.solve.chain import solve_chain
from tests.support.synthetic import synthetic_profile


def _chain(L, seed=0, sizes=(1, 2)):
    rng = random.Random(seed)
    per = lambda lo, hi: {b: rng.uniform(lo, hi) * (0.5 + b) for b in sizes}
    return synthetic_profile([per(1e-3, 1e-2) for _ in range(L)], [per(2e-3, 2e-2) for _ in range(L)],
                             [rng.randint(0, 8 << 20) for _ in range(L)], [rng.randint(0, 4 << 20) for _ in range(L)],
                             [rng.randint(0, 2 << 20) for _ in range(L - 1)], sizes=sizes)


@pytest.mark.skipif(bool(os.environ.get("PLANNER_SKIP_SLOW")), reason="PLANNER_SKIP_SLOW is set")
def test_thousand_unit_chain_at_16_stages_is_proven_optimal_fast():
    profile = _chain(1000)
    started = time.perf_counter()
    found = solve(profile, CostOptions(pipeline_ranks=16, global_batch=64, latency=1e-5))
    assert time.perf_counter() - started < 10.0
    assert found.gap == 0.0 and found.status == "optimal"
    assert found.cost.iteration_s == pytest.approx(found.objective, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_banded_chain_solver_equals_the_integer_program(seed):
    rng = random.Random(seed)
    profile = _chain(rng.randint(8, 30), seed, sizes=(2,))
    opts = CostOptions(pipeline_ranks=rng.randint(2, 6), global_batch=16, data_parallel=rng.choice([1, 2]),
                       bandwidth=rng.choice([1e8, 1e9]), latency=1e-4)
    fast = solve_chain(profile, 2, opts)
    assert evaluate(profile, fast.boundaries, 2, opts).iteration_s == pytest.approx(fast.objective, rel=1e-12)
    ilp = solve(profile, opts, warm_start=False)  # the integer program alone
    assert fast.objective == pytest.approx(ilp.objective, rel=1e-6)


def test_step_overhead_is_added_to_every_objective_and_bound():
    profile = _chain(12, 3)
    opts = CostOptions(pipeline_ranks=3, global_batch=8)
    base = solve(profile, opts)
    for method in ("ilp", "dp"):
        shifted = solve(profile, opts.with_(step_overhead_s=0.25), method=method)
        assert shifted.boundaries == base.boundaries
        assert shifted.objective == pytest.approx(base.objective + 0.25, rel=1e-12)
        assert shifted.bound == pytest.approx(shifted.objective) and shifted.gap == 0.0
    ilp = solve(profile, opts.with_(step_overhead_s=0.25), warm_start=False)
    assert ilp.objective == pytest.approx(base.objective + 0.25, rel=1e-9) and ilp.gap <= 1e-6
    cost = evaluate(profile, base.boundaries, base.micro_batch_size, opts.with_(step_overhead_s=0.25))
    assert cost.iteration_s == pytest.approx(base.cost.iteration_s + 0.25, rel=1e-12)


def test_solve_applies_the_profiles_calibration_unless_overridden(tmp_path, capsys):
    profile = _chain(10, 5)
    profile.extra["calibration"] = {"bandwidth_bytes_per_s": 2e8, "latency_s": 3e-4, "step_overhead_s": 0.1,
                                    "unit_scale": {}, "runs": 1}
    path = str(tmp_path / "p.json")
    save_profile(profile, path)
    out = str(tmp_path / "plan.json")
    assert main(["solve", path, "--stages", "2", "--global-batch", "8", "-o", out]) == 0
    printed = capsys.readouterr().out
    assert "applied the profile's calibration" in printed and "step overhead 100 ms" in printed
    opts = CostOptions(pipeline_ranks=2, global_batch=8, bandwidth=2e8, latency=3e-4, step_overhead_s=0.1)
    expected = solve(profile, opts)
    import json
    with open(out) as f:
        plan = json.load(f)
    assert plan["predicted_iteration_s"] == pytest.approx(expected.objective, rel=1e-9)
    assert main(["solve", path, "--stages", "2", "--global-batch", "8", "--bandwidth", "1GB", "--latency", "0",
                 "-o", out]) == 0
    printed = capsys.readouterr().out
    assert "bandwidth" not in printed.split("\n")[0] or "latency" not in printed.split("\n")[0]
    with open(out) as f:
        plan = json.load(f)
    explicit = solve(profile, opts.with_(bandwidth=1e9, latency=0.0))
    assert plan["predicted_iteration_s"] == pytest.approx(explicit.objective, rel=1e-9)
