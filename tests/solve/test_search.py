"""The search on random chains: the exact search against brute force (small chains) and against its
own fast heuristic (larger chains), under caps, recomputation, replicas and a per-stage call cost."""
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.solve.api import solve
from planner.solve.brute import solve_brute
from planner.solve.diagnose import InfeasibleError
from tests.support.solvers import both_solvers_match_brute_force
from tests.support.synthetic import random_chain, synthetic_profile


@st.composite
def chains(draw, max_units=14, max_stages=5, with_cap=True, apart=False):
    L = draw(st.integers(2, max_units))
    S = draw(st.integers(1, min(max_stages, L)))
    sizes = tuple(sorted(draw(st.sets(st.sampled_from((1, 2, 4)), min_size=1, max_size=3))))
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    profile = random_chain(rng, L, sizes, stage_overhead=True, apart=apart)
    opts = CostOptions(pipeline_ranks=S, global_batch=draw(st.sampled_from([4, 8, 16])),
                       schedule=draw(st.sampled_from(["1f1b", "gpipe"])), bandwidth=rng.choice([1e8, 1e9, 1e10]),
                       latency=rng.choice([0.0, 1e-4]), message_s=rng.choice([0.0, 5e-5]),
                       optimizer=rng.choice(["sgd", "adamw"]))
    step = rng.choice([0.0, 3e-3])
    for unit in profile.units:  # the optimizer step, on the path at the end of the step
        unit.optimizer_s = {"sgd": step / L, "adamw": 2 * step / L}
    if with_cap and draw(st.booleans()):
        free = solve(profile, opts, method="dp")  # a feasible plan's memory, to scale the cap
        peak = max(free.cost.device_memory)
        opts = opts.with_(memory_cap=peak * draw(st.floats(0.6, 1.0)))
    return profile, opts


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_the_heuristic_is_feasible_and_never_beats_the_exact_search(problem):
    profile, opts = problem
    try:
        exact = solve(profile, opts)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve(profile, opts, method="dp")
        return
    assert exact.status == "optimal" and exact.gap <= 1e-6
    fast = solve(profile, opts, method="dp")  # the starts and local search alone, with the scenarios' bound
    assert fast.cost.feasible and fast.objective >= exact.objective * (1 - 1e-9)
    assert fast.bound <= exact.objective * (1 + 1e-9)
    for found in (exact, fast):
        cost = evaluate(profile, found.boundaries, found.micro_batch_size, opts, found.recompute)
        assert cost.feasible and cost.iteration_s == pytest.approx(found.objective, rel=1e-12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(max_units=7, max_stages=4), st.sampled_from(["none", "all", "auto"]), st.sampled_from([1, 2]))
def test_exact_search_equals_brute_force(problem, recompute, replicas):
    profile, opts = problem
    both_solvers_match_brute_force(profile, opts.with_(recompute=recompute, data_parallel=replicas), ways=("search",))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(max_units=6, max_stages=3, apart=True), st.sampled_from(["1f1b", "gpipe", "zb-h1"]))
def test_the_program_alone_equals_brute_force_under_recompute_auto(problem, schedule):
    # the chains' storages shared by neighbours (d_k, r_k: planner.cost.ranges) enter the program's
    # memory rows through the recomputation variables; the branch and bound settles most scenarios
    # before the program is built, so it runs alone here
    profile, opts = problem
    both_solvers_match_brute_force(profile, opts.with_(recompute="auto", schedule=schedule), ways=("program",))


@pytest.mark.parametrize("seed", [15, 16, 23, 33])
def test_a_recomputed_stage_first_unit_frees_its_inputs_as_received(seed):
    """A unit starting a stage receives its inputs each in a storage of its own (first_a); recomputed, it
    keeps them alone (planner.cost.ranges): the program counted first_a still, and made no variable for a
    unit that frees bytes only so, and rejected the best plan under the cap (these seeds)."""
    rng = random.Random(seed)
    L = rng.randint(3, 6)
    S = rng.randint(2, min(3, L))
    profile = random_chain(rng, L, (1, 2), apart=True)
    opts = CostOptions(pipeline_ranks=S, global_batch=8, schedule=rng.choice(["1f1b", "gpipe"]), bandwidth=1e9)
    peak = max(solve(profile, opts, method="dp").cost.device_memory)
    first_recomputed = []  # the optimum's recomputed units that start a stage and receive inputs apart
    for share in (0.7, 0.85):
        oracle, _ = both_solvers_match_brute_force(profile, opts.with_(memory_cap=peak * share, recompute="auto"),
                                                   ways=("program",))
        if oracle is not None:
            first = range_costs(profile, oracle.micro_batch_size).first
            first_recomputed += [a for a in (0, *oracle.boundaries) if a in oracle.recompute and first[a] > 0]
    assert first_recomputed, "no optimum here recomputes such a unit: the case shows nothing"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(max_units=8, max_stages=4), st.sampled_from(["1f1b", "interleaved"]), st.sampled_from([0.02, 0.1, 0.3]))
def test_a_search_asked_for_a_gap_stops_within_it_and_its_bound_holds(problem, schedule, gap):
    """--gap: the plan is within the gap of its bound, and the bound of the best plan (brute force)."""
    profile, opts = problem
    opts = opts.with_(schedule=schedule, virtual_stages=2 if schedule == "interleaved" else 1)
    if opts.num_stages > profile.num_units:
        return
    try:
        opts.validate()
    except ValueError:
        return
    oracle = solve_brute(profile, opts)
    if oracle is None:
        with pytest.raises(InfeasibleError):
            solve(profile, opts, gap=gap)
        return
    found = solve(profile, opts, gap=gap)
    assert found.requested_gap == gap and found.gap <= gap
    assert found.bound <= oracle.objective * (1 + 1e-9) <= found.objective * (1 + 2e-9)
    assert found.objective * (1 - gap) <= oracle.objective * (1 + 1e-9)
    assert (found.status == "optimal") == (found.gap <= 1e-6)
    with pytest.raises(ValueError, match="optimality gap"):
        solve(profile, opts, gap=1.0)
    with pytest.raises(ValueError, match="does not search"):
        solve(profile, opts, method="dp", gap=gap)
    assert solve(profile, opts, method="dp").requested_gap == 1e-6  # nothing asked, nothing claimed


def test_the_heuristic_plans_interleaved_too():
    p = synthetic_profile([0.01] * 8, [0.02] * 8, [1] * 8, [1] * 8, [1] * 7)
    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule="interleaved", virtual_stages=2)
    fast, exact = solve(p, opts, method="dp"), solve(p, opts)
    assert fast.bound <= exact.objective <= fast.objective
    assert evaluate(p, fast.boundaries, fast.micro_batch_size, opts).iteration_s == pytest.approx(fast.objective)


def test_a_search_stopped_before_any_plan_is_not_called_infeasible(monkeypatch, tmp_path, capsys):
    # a short --time-limit at a tight cap: every scenario stopped with no plan and unproven; the
    # command said "infeasible" where a plan fits (a fuzz against brute force, 0.1-0.2 s limits)
    import time

    import planner.solve.search as search
    from planner.cli.main import main
    from planner.profile.profile import save_profile
    from planner.solve.diagnose import NoPlanInTime
    from planner.solve.exact import ScenarioOutcome

    profile = random_chain(random.Random(0), 6)
    opts = CostOptions(pipeline_ranks=2, global_batch=8)
    monkeypatch.setattr(search, "heuristic_plan", lambda *args, **kwargs: None)
    def stopped(*args, **kwargs):  # at the limit, with nothing
        time.sleep(0.2)
        return ScenarioOutcome(None, 0.0, False)

    monkeypatch.setattr(search, "solve_scenario", stopped)
    with pytest.raises(NoPlanInTime, match="no plan found within the time limit of 0.2 s"):
        solve(profile, opts, time_limit=0.2)
    path = str(tmp_path / "p.json")
    save_profile(profile, path)
    code = main(["solve", path, "--stages", "2", "--global-batch", "8", "--time-limit", "0.2", "-o",
                 str(tmp_path / "plan.json")])
    assert code == 2 and not (tmp_path / "plan.json").exists()
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no plan found within") and "infeasible" not in err and len(err.splitlines()) == 1
    monkeypatch.setattr(search, "solve_scenario", lambda *args, **kwargs: ScenarioOutcome(None, 0.0, True))
    with pytest.raises(InfeasibleError):  # each scenario proven to have none
        solve(profile, opts, time_limit=0.2)
    # a scenario stopped at its share of the limit with nothing is no proof either, though time is left
    # (the fuzz: bfs v=3 at a tight cap, 2 devices, --time-limit 0.31-0.35 said infeasible; a plan fits)
    monkeypatch.setattr(search, "solve_scenario", lambda *args, **kwargs: ScenarioOutcome(None, 0.0, False))
    with pytest.raises(NoPlanInTime):
        solve(profile, opts, time_limit=60)
    # an unsettled scenario whose bound is +inf (the program proved it has no split) is a proof
    monkeypatch.setattr(search, "solve_scenario", lambda *args, **kwargs: ScenarioOutcome(None, math.inf, False))
    with pytest.raises(InfeasibleError):
        solve(profile, opts, time_limit=60)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), L=st.integers(2, 40), S=st.integers(1, 8))
def test_past_the_starts_deadline_an_even_split_is_the_start(seed, L, S):
    """Each start but the even split takes O(S L^2) (seconds at thousands of units); past the
    deadline the search still gets one: a valid split with each stage near 1/S of the work."""
    import time

    from planner.solve.search import _starts

    if S > L:
        return
    profile = random_chain(random.Random(seed), L, sizes=(1,))
    opts = CostOptions(pipeline_ranks=S, global_batch=4)
    (split,) = _starts(profile, 1, opts, deadline=time.perf_counter() - 1)
    assert len(split) == S - 1 and all(a < b for a, b in zip([0] + split, split + [L]))
    work = [sum(u.forward_s[1] + u.backward_s[1] for u in profile.units[a:e])
            for a, e in zip([0] + split, split + [L])]
    largest = max(u.forward_s[1] + u.backward_s[1] for u in profile.units)
    assert max(work) <= sum(work) / S + 2 * largest + 1e-12


def test_time_left_after_scenarios_stopped_with_nothing_goes_to_them_again(monkeypatch):
    # each scenario's first try stops at its share with no plan while the limit has time left (a
    # later scenario settled at once): the search said "no plan within the time limit" at a part of it
    import planner.solve.search as search
    from planner.solve.exact import ScenarioOutcome

    profile = random_chain(random.Random(1), 6)
    opts = CostOptions(pipeline_ranks=2, global_batch=8)
    real, calls = search.solve_scenario, []
    monkeypatch.setattr(search, "heuristic_plan", lambda *args, **kwargs: None)

    def first_stopped(*args, **kwargs):
        calls.append(args[1])  # the micro-batch size
        if len(calls) <= len(search.candidate_micro_batch_sizes(profile, 8, opts)):
            return ScenarioOutcome(None, 0.0, False)
        return real(*args, **kwargs)

    monkeypatch.setattr(search, "solve_scenario", first_stopped)
    found = solve(profile, opts, time_limit=60)
    exact = solve(profile, opts)
    assert found.objective == pytest.approx(exact.objective)
    assert len(calls) > len(search.candidate_micro_batch_sizes(profile, 8, opts))


def test_brute_force_recomputes_a_unit_that_frees_only_what_it_shares():
    # a unit saving no more than its inputs frees, recomputed, the model input it reads that the unit
    # before saves too (r_k); brute force never tried recomputing it, and the program's plan ([1, 2]
    # recomputed, 1.5433 s) beat "the optimum" ([0, 1], 1.5568 s). (Since r_k may be negative, where the
    # recomputed unit no longer saves what it shared, [1, 2] counts more and no longer fits: brute force
    # must still weigh unit 2, and the program agree with it.)
    from planner.solve.chain_recompute import freed_bytes, worth_recomputing
    from planner.cost.ranges import range_costs
    from tests.support.solvers import program_only

    rng = random.Random(2371)
    L = rng.randint(2, 6)
    S = rng.randint(1, min(3, L))
    profile = random_chain(rng, L, tuple(sorted(rng.sample([1, 2, 4], rng.randint(1, 3)))), stage_overhead=True)
    opts = CostOptions(pipeline_ranks=S, global_batch=rng.choice([4, 8, 16]), schedule=rng.choice(["1f1b", "gpipe"]),
                       bandwidth=rng.choice([1e8, 1e9, 1e10]), latency=rng.choice([0.0, 1e-4]),
                       message_s=rng.choice([0.0, 5e-5]), optimizer=rng.choice(["sgd", "adamw"]))
    step = rng.choice([0.0, 3e-3])
    for unit in profile.units:
        unit.optimizer_s = {"sgd": step / L, "adamw": 2 * step / L}
    free = solve(profile, opts, method="dp")
    opts = opts.with_(memory_cap=max(free.cost.device_memory) * rng.uniform(0.6, 1.0), recompute="auto",
                      schedule=rng.choice(["1f1b", "gpipe", "zb-h1"]))
    assert opts.schedule == "gpipe" and (L, S) == (6, 3)
    oracle = solve_brute(profile, opts)
    costs = range_costs(profile, oracle.micro_batch_size)
    assert costs.s[2] <= costs.inputs[2] and freed_bytes(costs, 1, 3)[1] > 0  # frees only after unit 1
    with program_only():
        found = solve(profile, opts)
    assert found.objective == pytest.approx(oracle.objective, rel=1e-9) and worth_recomputing(costs, opts.schedule)[2]


def test_every_unit_recomputed_a_stage_start_whose_r_is_negative_is_not_fixed_out():
    # r_k < 0 where recomputed unit k no longer saves the table it shared with k - 1; at a stage's start the
    # model gives r_a back (the unit keeps in_a). The fixings counted in_a - r_a there, so the split at 2 (the
    # optimum, fitting its cap exactly) was ruled out: the program alone said infeasible, and without its warm
    # start the search's optimum was not brute force's (found by the twenty-sixth session's oracle campaign)
    from planner.cost.model import evaluate
    from planner.cost.ranges import RangeCosts
    from planner.solve.exact import _fixings
    from tests.support.solvers import program_only
    from tests.support.synthetic import synthetic_profile

    mib, L, b = 1 << 20, 4, 2
    profile = synthetic_profile([1e-3] * L, [2e-3] * L, [mib] * L, [4 * mib] * L, [mib] * (L - 1), sizes=(b,))
    before, after = profile.units[1], profile.units[2]
    before.shared_saved_bytes[b] = {"table": 6 * mib, "ids": 64 * 1024}  # both save the table (d_2)
    after.shared_saved_bytes[b] = {"table": 6 * mib}
    for unit in (before, after):  # recomputed, each keeps the ids alone
        unit.recomputed_shared_bytes[b] = {"ids": 64 * 1024}
        unit.input_bytes[b] = 64 * 1024
    assert RangeCosts(profile, b).redo_dup[2] < 0
    free = CostOptions(pipeline_ranks=2, global_batch=8, schedule="1f1b", bandwidth=1e9, recompute="all")
    opts = free.with_(memory_cap=max(evaluate(profile, [2], b, free, range(L)).device_memory))
    assert _fixings(profile, b, opts, set(), math.inf) == ([0, 0, 1, 1], [0, 0, 1, 1])
    oracle = solve_brute(profile, opts)
    assert oracle.boundaries == [2]
    for warm in (True, False):
        assert solve(profile, opts, warm_start=warm).objective == pytest.approx(oracle.objective, rel=1e-9)
        with program_only():
            assert solve(profile, opts, warm_start=warm).objective == pytest.approx(oracle.objective, rel=1e-9)


def _layouts(profile, cap):
    """Every p x d of 8 devices for `profile` under `cap`, 1F1B, recomputation chosen."""
    from planner.solve.search import expand_scenarios

    opts = CostOptions(pipeline_ranks=1, global_batch=16, memory_cap=cap, recompute="auto", optimizer="adamw")
    return expand_scenarios(opts, profile.num_units, devices=8)


def test_a_layout_no_split_fits_is_proven_empty_and_gets_no_start():
    """Few pipeline ranks hold too many parameters for the cap whatever they recompute: their bound is
    +inf (no stage range fits its device), so no start is sought for them (each a search of its own,
    seconds at a large profile) and the plan and bound come from the layouts that fit."""
    from unittest import mock

    from planner.cost.model import candidate_micro_batch_sizes
    from planner.solve import search
    from planner.solve.diagnose import min_memory_plan

    profile = random_chain(random.Random(5), 12, sizes=(1, 2))
    for unit in profile.units:
        unit.param_bytes = unit.trainable_bytes = 4 << 20
    # a cap between what 4 and 8 pipeline ranks need with every unit recomputed
    floors = {o.pipeline_ranks: min_memory_plan(profile, o.with_(recompute="all")).memory_bytes
              for o in _layouts(profile, None)}
    assert floors[4] > floors[8]
    scenarios = _layouts(profile, (floors[4] + floors[8]) / 2)
    bounds = {(o.pipeline_ranks, b): search.scenario_lower_bound(profile, b, o) for o in scenarios
              for b in candidate_micro_batch_sizes(profile, o.global_batch, o)}
    assert {p for (p, _), bound in bounds.items() if math.isinf(bound)} == {1, 2, 4}
    started = []
    real = search.heuristic_plan
    with mock.patch.object(search, "heuristic_plan",
                           lambda profile, b, opts, **kw: started.append(opts.pipeline_ranks) or real(profile, b, opts, **kw)):
        found = search.search_scenarios(profile, scenarios, "ilp", time_limit=30)
    assert set(started) == {8} and found.options.pipeline_ranks == 8 and found.status == "optimal"


def test_the_structural_forms_stop_at_their_deadline():
    from planner.solve.exact import STRUCTURAL_BATCH, structural_forms

    profile = random_chain(random.Random(1), 12, sizes=(2,))
    opts = CostOptions(pipeline_ranks=6, global_batch=24)  # 3 x 6 + 8 = 26 duration sets: two batches
    every = structural_forms(profile, 2, opts)
    first = structural_forms(profile, 2, opts, deadline=0.0)  # the first batch, then the deadline
    assert 1 <= len(first) <= STRUCTURAL_BATCH and first < every
    assert structural_forms(profile, 2, opts, deadline=math.inf) == every


def test_the_search_tells_its_progress_in_lines():
    """solve(progress=...) hears the scenarios counted, then a line each time the best plan or the bound moved;
    the last one is the solution's."""
    profile = random_chain(random.Random(4), 9, sizes=(1, 2))
    lines = []
    found = solve(profile, CostOptions(pipeline_ranks=1, global_batch=8), devices=4, progress=lines.append)
    assert "scenarios (layout x micro-batch size)" in lines[0] and len(lines) >= 2
    assert f"best {found.objective * 1e3:.1f} ms ({found.options.pipeline_ranks} x {found.options.data_parallel}" \
        in lines[-1] and f"bound {found.bound * 1e3:.1f} ms" in lines[-1]
    told = [line.split(" s  ", 1)[1] for line in lines[1:]]  # said again only when something moved
    assert all(a != b for a, b in zip(told, told[1:]))


@pytest.mark.parametrize("seed", range(6))
def test_the_chain_shifts_move_runs_of_boundaries_and_keep_every_stage(seed):
    """planner.solve.local_search._shifts: every run of two or more consecutive boundaries moved one unit together,
    each a valid split (a unit at least per stage), all of them where nothing blocks a move."""
    from planner.solve.local_search import _shifts

    rng = random.Random(seed)
    L, S = rng.randint(6, 20), rng.randint(3, 6)
    boundaries = sorted(rng.sample(range(1, L), S - 1))
    seen = list(_shifts(boundaries, L))
    expected = []
    for j1 in range(S - 1):
        for j2 in range(j1 + 1, S - 1):
            for step in (-1, 1):
                moved = [c + step if j1 <= k <= j2 else c for k, c in enumerate(boundaries)]
                if all(0 < c < L for c in moved) and all(x < y for x, y in zip(moved, moved[1:])):
                    expected.append(moved)
    assert sorted(seen) == sorted(expected)
    assert len(set(map(tuple, seen))) == len(seen)


@pytest.mark.parametrize("seed", range(4))
def test_the_interleaved_local_search_ends_where_no_chain_shift_helps(seed):
    """With several stages per device the local search stops only at a split no single-boundary move and no
    chain shift makes faster (unlimited time), never slower than its start."""
    from planner.cost.model import simulate_splits
    from planner.solve.local_search import _shifts, local_search, neighbours
    from planner.solve.solution import Candidate

    rng = random.Random(seed)
    p = rng.randint(2, 3)
    L = rng.randint(2 * p + 2, 2 * p + 8)
    profile = random_chain(rng, L, sizes=(1,))
    opts = CostOptions(pipeline_ranks=p, global_batch=2 * p, schedule=rng.choice(["interleaved", "bfs"]),
                       virtual_stages=2, optimizer="sgd")
    start = sorted(rng.sample(range(1, L), 2 * p - 1))
    cost = evaluate(profile, start, 1, opts)
    found = local_search(profile, 1, opts, Candidate(cost.iteration_s, start, []), set())
    assert found.iteration_s <= cost.iteration_s
    assert evaluate(profile, found.boundaries, 1, opts).iteration_s == pytest.approx(found.iteration_s, rel=1e-12)
    moves = list(neighbours(found.boundaries, L)) + list(_shifts(found.boundaries, L))
    steps = [s for s, _ in filter(None, simulate_splits(profile, [(m, []) for m in moves], 1, opts))]
    assert min(steps) >= found.iteration_s * (1 - 1e-12)
