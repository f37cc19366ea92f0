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
from tests.support.synthetic import random_chain


def _chain(L, seed=0, sizes=(1, 2)):
    return random_chain(random.Random(seed), L, sizes)


@pytest.mark.skipif(bool(os.environ.get("PLANNER_SKIP_SLOW")), reason="PLANNER_SKIP_SLOW is set")
def test_long_chains_get_an_honest_certificate_in_time():
    """A 300-unit chain at 16 stages is proven optimal; a 1000-unit one stops at its time limit with
    a plan whose objective is its simulation and a bound that holds (benchmarks/solver_speed.py)."""
    for units, limit in ((300, None), (1000, 2.0)):
        profile = _chain(units)
        started = time.perf_counter()
        found = solve(profile, CostOptions(pipeline_ranks=16, global_batch=64, latency=1e-5), time_limit=limit)
        if limit is not None:
            assert time.perf_counter() - started < 4 * limit + 10.0  # the heuristics before the program
        else:
            assert found.gap <= 1e-6 and found.status == "optimal"
        assert found.cost.iteration_s == pytest.approx(found.objective, rel=1e-12)
        assert 0 < found.bound <= found.objective
        assert found.gap == pytest.approx((found.objective - found.bound) / found.objective, abs=1e-12)


def _fill_drain(profile, b, opts, boundaries):
    """The chain solver's objective (planner.solve.chain's docstring), written out for one split."""
    from planner.cost.model import cut_time, sync_time

    L, m = profile.num_units, opts.global_batch // (opts.data_parallel * b)
    edges = [0] + list(boundaries) + [L]
    call = sum(profile.stage_overhead(b))
    T, E = [], []
    for a, e in zip(edges, edges[1:]):
        work = sum(u.forward_s[b] + u.backward_s[b] for u in profile.units[a:e])
        T.append(work + (call + cut_time(profile, a, b, opts) if a > 0 else call) +
                 (cut_time(profile, e, b, opts) if e < L else 0.0))
        params = sum(u.param_bytes for u in profile.units[a:e])
        E.append(sync_time(params, params, 0.0, opts, profile.dtype, m) if opts.data_parallel > 1 else 0.0)
    return sum(T) + (m - 1) * max(T) + max(E)


@pytest.mark.parametrize("seed", range(6))
def test_banded_chain_solver_is_exact_for_the_fill_drain_form(seed):
    """The chain solver (the search's first start) minimises its closed form exactly: brute force."""
    import itertools

    rng = random.Random(seed)
    profile = _chain(rng.randint(6, 11), seed, sizes=(2,))
    opts = CostOptions(pipeline_ranks=rng.randint(2, 4), global_batch=16, data_parallel=rng.choice([1, 2]),
                       bandwidth=rng.choice([1e8, 1e9]), latency=1e-4)
    fast = solve_chain(profile, 2, opts)
    best = min(_fill_drain(profile, 2, opts, split)
               for split in itertools.combinations(range(1, profile.num_units), opts.num_stages - 1))
    assert fast.objective == pytest.approx(best, rel=1e-9)
    assert _fill_drain(profile, 2, opts, fast.boundaries) == pytest.approx(best, rel=1e-9)


def test_chain_search_past_its_deadline_gives_the_split_it_has():
    """The chain search is the solver's first start; on large profiles it took minutes and the time
    limit only began after it. Past its deadline it stops with a valid split (not claimed exact), or
    with none where the deadline came before its first table (the search then starts from an even split)."""
    profile = _chain(60, 4)
    opts = CostOptions(pipeline_ranks=4, global_batch=16, data_parallel=2, bandwidth=1e8, latency=1e-4)
    from types import SimpleNamespace
    from unittest import mock

    from planner.solve import chain, floors

    exact = solve_chain(profile, 2, opts)
    # the deadline passes once the first band is made (its tables' clock stands before it)
    with mock.patch.object(chain, "time", SimpleNamespace(perf_counter=lambda: 2.0)), \
            mock.patch.object(floors, "time", SimpleNamespace(perf_counter=lambda: 0.0)):
        cut = solve_chain(profile, 2, opts, deadline=1.0)
    assert exact.exact and not cut.exact and cut.evaluations <= exact.evaluations
    assert len(cut.boundaries) == opts.num_stages - 1 and cut.objective >= exact.objective * (1 - 1e-12)
    assert _fill_drain(profile, 2, opts, cut.boundaries) == pytest.approx(cut.objective - opts.step_overhead_s)
    # past it before any band (one takes seconds at thousands of units): no split from here
    assert solve_chain(profile, 2, opts, deadline=time.perf_counter() - 1) is None
    # past it while a later band is made: the last whole band's split, its value read from its tables
    import itertools

    # (here: the first band holds no split, the second the min-max split, the third the search's band)
    def stopped_in_band(k):  # the tables' clock ticks once per stage of a band: band k runs out
        ticks = itertools.count()
        with mock.patch.object(chain, "time", SimpleNamespace(perf_counter=lambda: 0.0)), \
                mock.patch.object(floors, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks)))):
            return solve_chain(profile, 2, opts, deadline=(k - 1) * opts.num_stages + 0.5)

    assert stopped_in_band(2) is None
    second = stopped_in_band(3)
    assert not second.exact and second.objective >= exact.objective * (1 - 1e-12)
    assert _fill_drain(profile, 2, opts, second.boundaries) == pytest.approx(second.objective - opts.step_overhead_s)


def test_step_overhead_is_added_to_every_objective_and_bound():
    profile = _chain(12, 3)
    opts = CostOptions(pipeline_ranks=3, global_batch=8)
    base = solve(profile, opts)
    for method in ("ilp", "dp"):
        plain = solve(profile, opts, method=method)
        shifted = solve(profile, opts.with_(step_overhead_s=0.25), method=method)
        assert shifted.boundaries == plain.boundaries
        assert shifted.objective == pytest.approx(plain.objective + 0.25, rel=1e-12)
        assert shifted.bound == pytest.approx(plain.bound + 0.25, rel=1e-9)
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


def test_past_the_starts_deadline_only_one_scenario_gets_a_starting_plan(monkeypatch):
    # each start is a simulation of its lists (seconds for 8 stages x 32 micro-batches): a time limit
    # of 0.01 s took 5.7 s on a 40-unit chain over 24 scenarios
    import planner.solve.search as search

    calls = []
    real = search.heuristic_plan
    monkeypatch.setattr(search, "heuristic_plan", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    profile = random_chain(random.Random(1), 12)
    found = solve(profile, CostOptions(pipeline_ranks=4, global_batch=16), time_limit=1e-6,
                  schedules=["1f1b", "gpipe", "zb-h1"])
    assert len(calls) == 1 and found.cost.feasible and found.bound <= found.objective
    calls.clear()
    solve(profile, CostOptions(pipeline_ranks=4, global_batch=16), schedules=["1f1b", "gpipe", "zb-h1"])
    assert len(calls) > 3  # without a limit every scenario starts from its own


def test_the_command_searches_a_minute_at_most_unless_told_inf(tmp_path, capsys, monkeypatch):
    import planner.solve.api as api

    seen = []
    real = api.solve
    monkeypatch.setattr(api, "solve", lambda *a, **k: seen.append(k["time_limit"]) or real(*a, **k))
    path = str(tmp_path / "profile.json")
    save_profile(random_chain(random.Random(0), 6), path)
    for extra in ([], ["--time-limit", "inf"], ["--time-limit", "5"]):
        assert main(["solve", path, "--stages", "2", "-o", str(tmp_path / "plan.json"), *extra]) == 0
    assert seen == [60.0, None, 5.0]
