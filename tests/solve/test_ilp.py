"""The integer program against the brute-force oracle, the bound it reports, and the diagnosis."""
import itertools
import math
import random
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.cost.model import candidate_micro_batch_sizes, evaluate
from planner.cost.options import CostOptions
from planner.sizes import format_bytes
from planner.solve.api import solve, solve_ilp
from planner.solve.backends import _parse_cbc_log
from planner.solve.brute import solve_brute
from planner.solve.diagnose import InfeasibleError, min_memory_plan
from tests.support.solvers import program_only
from tests.support.synthetic import synthetic_profile

SIZES = (1, 2, 4, 8)


@st.composite
def problems(draw, max_units=7, max_stages=4):
    """A random small profile and request; the memory cap is drawn around the memory floor."""
    L = draw(st.integers(2, max_units))
    S = draw(st.integers(1, min(max_stages, L)))
    sizes = tuple(sorted(draw(st.sets(st.sampled_from(SIZES), min_size=1, max_size=4))))
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))

    def per_size(base, per_sample):  # fixed overhead + per-sample cost: bigger b is more efficient
        t0, t1 = rng.uniform(*base), rng.uniform(*per_sample)
        return {b: t0 + t1 * b for b in sizes}

    forward = [per_size((1e-3, 1e-2), (1e-4, 2e-3)) for _ in range(L)]
    backward = [per_size((1e-3, 2e-2), (1e-4, 4e-3)) for _ in range(L)]
    params = [rng.choice([0, rng.randint(1, 8 << 20)]) for _ in range(L)]
    saved = [rng.randint(0, 2 << 20) for _ in range(L)]
    act = [rng.choice([0, rng.randint(1, 1 << 20)]) for _ in range(L - 1)]
    grad = [rng.choice([a, a // 2, 0]) for a in act]
    # half the profiles charge every stage its own cost per micro-batch (a measured profile's
    # stage_overhead_s), so the ILP and the oracle must agree on it too
    overhead = {b: (rng.uniform(0, 2e-3), rng.uniform(0, 3e-3)) for b in sizes} if rng.random() < 0.5 else None
    profile = synthetic_profile(forward, backward, params, saved, act, grad, sizes=sizes, stage_overhead=overhead)
    schedule = draw(st.sampled_from(["1f1b", "gpipe"]))
    optimizer = draw(st.sampled_from(["sgd", "adamw"]))
    base = CostOptions(pipeline_ranks=S, global_batch=draw(st.sampled_from([8, 16])), schedule=schedule,
                       bandwidth=rng.choice([1e8, 1e9, 1e10]), latency=rng.choice([0.0, 1e-4]),
                       optimizer=optimizer, message_s=rng.choice([0.0, 5e-5]))
    step = rng.choice([0.0, 3e-3])
    for unit in profile.units:  # the optimizer step at the end of each rank's list
        unit.optimizer_s = {"sgd": step / L, "adamw": 2 * step / L}
    # cap between the memory floor (t = 0) and the peak of the unconstrained optimum (t = 1):
    # t < 0 is infeasible, 0 <= t < 1 usually binds, None is no cap
    t = draw(st.one_of(st.none(), st.floats(-0.1, 1.1)))
    if t is None:
        return profile, base
    floor = min_memory_plan(profile, base).memory_bytes
    free = solve_brute(profile, base)
    peak = max(free.cost.device_memory)
    return profile, CostOptions(**{**base.__dict__, "memory_cap": max(1.0, floor + t * (peak - floor))})


def assert_matches_oracle(profile, opts, **kwargs):
    oracle = solve_brute(profile, opts)
    if oracle is None:
        with pytest.raises(InfeasibleError):
            solve_ilp(profile, opts, **kwargs)
        return None
    found = solve_ilp(profile, opts, **kwargs)
    assert found.objective == pytest.approx(oracle.objective, rel=1e-6)
    cost = evaluate(profile, found.boundaries, found.micro_batch_size, opts)
    assert cost.feasible and cost.iteration_s == found.objective
    assert found.bound <= found.objective + 1e-12
    assert found.status == "optimal" and found.gap <= 1e-6
    assert found.num_micro_batches * found.micro_batch_size == opts.global_batch
    return found


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_ilp_matches_brute_force(problem):
    profile, opts = problem
    with program_only():
        assert_matches_oracle(profile, opts, warm_start=False)  # the integer program on its own
        assert_matches_oracle(profile, opts)  # with the DP warm start


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_units=6, max_stages=3))
def test_highs_agrees_with_cbc(problem):
    profile, opts = problem
    with program_only():
        if solve_brute(profile, opts) is None:
            with pytest.raises(InfeasibleError):
                solve_ilp(profile, opts, backend="highs")
            return
        highs = assert_matches_oracle(profile, opts, backend="highs", warm_start=False)
        cbc = solve_ilp(profile, opts, backend="cbc")
        assert highs.objective == pytest.approx(cbc.objective, rel=1e-6)
        assert (highs.backend, cbc.backend) == ("highs", "cbc")


def brute_memory_floor(profile, opts):
    """min over b and splits of max_s M_s, by enumeration (every unit recomputed under --recompute all)."""
    best = math.inf
    redo = list(range(profile.num_units)) if opts.recompute == "all" else []
    for boundaries in itertools.combinations(range(1, profile.num_units), opts.pipeline_ranks - 1):
        for b in candidate_micro_batch_sizes(profile, opts.global_batch):
            cost = evaluate(profile, list(boundaries), b, opts, redo)
            best = min(best, max(cost.device_memory))
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["none", "all"]))
def test_infeasible_diagnosis_is_tight(problem, recompute):
    profile, opts = problem
    opts = opts.with_(recompute=recompute)
    floor = brute_memory_floor(profile, opts)
    assert min_memory_plan(profile, opts).memory_bytes == floor
    assume(floor > 0)  # nothing held (no parameters; under recompute all, nothing crossing): nothing to exceed
    tight = CostOptions(**{**opts.__dict__, "memory_cap": floor})
    solved = solve(profile, tight)
    assert max(solved.cost.device_memory) <= floor
    short = CostOptions(**{**opts.__dict__, "memory_cap": floor * 0.999})
    assert solve_brute(profile, short) is None
    with pytest.raises(InfeasibleError) as info:
        solve(profile, short)
    message = str(info.value)
    assert "stage" in message and format_bytes(floor) in message
    assert info.value.min_memory_bytes == floor
    assert len(message.splitlines()) == 1


def test_the_floor_under_recompute_auto_is_hedged():
    """Under --recompute auto the diagnosis's floor is the least of the splits without recomputation and
    recomputing every unit: a choice of some units may need less, so it does not say 'at least' (under
    none it is exact)."""
    p = synthetic_profile([0.01] * 4, [0.02] * 4, [1 << 20] * 4, [8 << 20] * 4, [1000] * 3)
    for recompute, says in (("none", "allow at least"), ("auto", "what fits when recomputing every unit; "
                                                                  "recomputing some units may fit in less")):
        with pytest.raises(InfeasibleError) as info:
            solve(p, CostOptions(pipeline_ranks=2, global_batch=4, memory_cap=1 << 20, recompute=recompute))
        assert says in str(info.value), recompute
        assert ("at least" in str(info.value)) == (recompute == "none")


@pytest.mark.parametrize("recompute", ["none", "auto"])
def test_the_stage_count_the_diagnosis_names_fits_and_none_fits_where_it_says_so(recompute):
    # under auto the stage counts were counted without recomputation: "no number of stages fits" where
    # three stages fit by recomputing some units (a helper's sweep, TransformerEncoderLayer under GPipe)
    rng = random.Random(7)
    said = set()
    for _ in range(25):
        L = rng.randint(3, 5)
        p = synthetic_profile([0.01] * L, [0.02] * L, [rng.randint(1, 4) << 20 for _ in range(L)],
                              [rng.randint(0, 3) << 20 for _ in range(L)], [rng.randint(1, 4) << 20 for _ in range(L - 1)])
        opts = CostOptions(pipeline_ranks=2, global_batch=4, schedule=rng.choice(["gpipe", "1f1b"]), recompute=recompute,
                           memory_cap=rng.randint(8, 64) << 20)
        try:
            solve(p, opts)
            continue
        except InfeasibleError as e:
            message = str(e)
        fits = [S for S in range(1, L + 1) if _solves(p, opts.with_(pipeline_ranks=S))]
        named = re.search(r"or use (\d+) stages", message)
        if named:
            said.add("use")
            assert int(named.group(1)) in fits, (message, fits)
        else:
            said.add("none")
            assert "no number of stages" in message and not fits, (message, fits)
    assert said == {"use", "none"}


def _solves(profile, opts) -> bool:
    try:
        solve(profile, opts)
        return True
    except InfeasibleError:
        return False


def test_infeasible_message_names_stage_and_stage_count():
    # one huge unit at the end: 4 units, stage memories dominated by unit 3
    p = synthetic_profile([0.01] * 4, [0.02] * 4, [1 << 20, 1 << 20, 1 << 20, 64 << 20], [0] * 4, [1000] * 3,
                          names=["embed", "block0", "block1", "head"])
    opts = CostOptions(pipeline_ranks=2, global_batch=4, memory_cap=100 << 20)
    with pytest.raises(InfeasibleError) as info:
        solve(p, opts)
    message = str(info.value)
    assert "stage 1" in message and "'head'" in message and "128.0 MiB" in message
    assert "28.0 MiB over the cap" in message
    assert "no number of stages" in message  # 'head' alone needs 128 MiB
    roomy = CostOptions(pipeline_ranks=1, global_batch=4, memory_cap=100 << 20)
    p2 = synthetic_profile([0.01] * 4, [0.02] * 4, [20 << 20] * 4, [0] * 4, [1000] * 3)
    with pytest.raises(InfeasibleError, match="use 2 stages"):
        solve(p2, roomy)


def test_other_infeasible_requests():
    p = synthetic_profile([0.01] * 3, [0.02] * 3, [0] * 3, [0] * 3, [10, 10], sizes=(2, 4))
    with pytest.raises(InfeasibleError, match=r"profiled: 2, 4.*e\.g\. 8"):
        solve(p, CostOptions(pipeline_ranks=2, global_batch=7))
    with pytest.raises(InfeasibleError, match="only 3 units"):
        solve(p, CostOptions(pipeline_ranks=4, global_batch=8))
    with pytest.raises(InfeasibleError, match="only 3 units"):
        solve(p, CostOptions(pipeline_ranks=4, global_batch=8), method="brute")
    # two ranks of two stages each need four units: said so, not "no plan fits the memory"
    with pytest.raises(InfeasibleError, match="2 ranks' stages .interleaved: several per rank. outnumber the profile's "
                                              "3 units"):
        solve(p, CostOptions(pipeline_ranks=2, global_batch=8, schedule="interleaved", virtual_stages=2))
    # no layout at all: said so, not "a plan fits" (the memory floor of a request never searched)
    with pytest.raises(InfeasibleError, match="3 ranks' stages .zb-v: several per rank. outnumber the profile's 3"):
        solve(p, CostOptions(pipeline_ranks=3, global_batch=8, schedule="zb-v", virtual_stages=2))
    # more ranks than units under --schedule auto: no schedule has a layout, one stage per rank included (it
    # blamed the schedules of several stages per rank and proposed one stage per rank)
    with pytest.raises(InfeasibleError, match="4 stages requested but the profile has only 3 units"):
        solve(p, CostOptions(pipeline_ranks=4, global_batch=8), schedules=["1f1b", "interleaved", "zb-v"])
    # (it listed the divisors of 5, [1, 5], as if d = 5 were allowed)
    with pytest.raises(InfeasibleError, match=r"no way to lay out 5 devices.*dividing both 5 and the global batch 8 "
                                              r"\(d in \[1\], so p at least 5\)"):
        solve(p, CostOptions(pipeline_ranks=1, global_batch=8), devices=5)


def test_no_micro_batch_size_is_told_which_rule_every_size_breaks():
    p = synthetic_profile([0.01] * 4, [0.02] * 4, [0] * 4, [0] * 4, [10, 10, 10], sizes=(2, 4))
    with pytest.raises(InfeasibleError, match=r"no profiled micro-batch size divides the global batch 6 over 2 replicas "
                                              r"\(profiled: 2, 4\); .* multiple of 2 x one of them, e.g. 8"):
        solve(p, CostOptions(pipeline_ranks=1, global_batch=6, data_parallel=2))
    # 2 and 4 divide 20,000, as 10,000 and 5,000 micro-batches
    with pytest.raises(InfeasibleError, match="the global batch 20000 makes more than 4096 micro-batches of every "
                                              "profiled size that divides it"):
        solve(p, CostOptions(pipeline_ranks=2, global_batch=20000))
    # interleaved on 2 ranks: 6 = 3 x 2 and 6 is no multiple of 4
    with pytest.raises(InfeasibleError, match="interleaved runs a number of micro-batches that is a multiple of its 2 "
                                              "ranks, and the global batch 6 makes 3 of 2"):
        solve(p, CostOptions(pipeline_ranks=2, global_batch=6, schedule="interleaved", virtual_stages=2))


def test_no_plan_over_several_layouts_and_a_baseline_that_does_not_fit_say_so():
    p = synthetic_profile([0.01] * 4, [0.02] * 4, [4 << 20] * 4, [1 << 20] * 4, [10, 10, 10], sizes=(2,))
    with pytest.raises(InfeasibleError, match=r"none of the 3 layouts tried \(pipeline ranks x replicas: 1 x 4 1f1b, "
                                              r"2 x 2 1f1b, 4 x 1 1f1b\) has a plan; e.g. no plan fits 1.0 MiB per device"):
        solve(p, CostOptions(pipeline_ranks=1, global_batch=16, memory_cap=1 << 20), devices=4)
    # the uniform baseline puts both heavy units on stage 0 (32 MiB); under 20 MiB only one each fits
    q = synthetic_profile([0.01] * 4, [0.02] * 4, [8 << 20, 8 << 20, 0, 0], [0] * 4, [10, 10, 10], sizes=(2,))
    opts = CostOptions(pipeline_ranks=2, global_batch=8, memory_cap=20 << 20)
    assert solve(q, opts).cost.feasible
    with pytest.raises(InfeasibleError, match="the uniform baseline's split does not fit the memory per device, but "
                                              "another split does .*; --method ilp finds the best one"):
        solve(q, opts, method="uniform")


def big_profile(L=60, seed=3):
    rng = random.Random(seed)
    per = lambda a, b: {s: rng.uniform(*a) + rng.uniform(*b) * s for s in SIZES}
    return synthetic_profile([per((1e-3, 1e-2), (1e-4, 1e-3)) for _ in range(L)],
                             [per((1e-3, 2e-2), (1e-4, 2e-3)) for _ in range(L)],
                             [rng.randint(0, 4 << 20) for _ in range(L)], [rng.randint(0, 2 << 20) for _ in range(L)],
                             [rng.randint(0, 1 << 20) for _ in range(L - 1)], sizes=SIZES)


@pytest.mark.parametrize("backend", ["cbc", "highs"])
def test_time_limited_solve_reports_a_valid_bound(backend):
    p = big_profile()
    opts = CostOptions(pipeline_ranks=8, global_batch=32, latency=1e-4, bandwidth=1e9, memory_cap=80e6)
    found = solve_ilp(p, opts, time_limit=0.5, backend=backend)  # (0.05 s: no plan yet on a loaded machine)
    assert found.status in ("optimal", "feasible")
    assert 0 < found.bound <= found.objective + 1e-9
    assert found.gap == pytest.approx((found.objective - found.bound) / found.objective, abs=1e-12)
    if found.status == "optimal":
        assert found.gap <= 1e-6
    cost = evaluate(p, found.boundaries, found.micro_batch_size, opts)
    assert cost.feasible and cost.iteration_s == found.objective


def test_brute_refuses_huge_searches():
    with pytest.raises(ValueError, match="use the ILP"):
        solve_brute(big_profile(), CostOptions(pipeline_ranks=8, global_batch=32))


def test_cbc_log_parsing():
    stopped = ("Result - Stopped on time limit\n\nObjective value:                2682.85905674\n"
               "Lower bound:                    2568.340\nGap:                            0.04\n")
    result, objective, bound = _parse_cbc_log(stopped)
    assert result == "Stopped on time limit" and objective == pytest.approx(2682.85905674)
    assert bound == pytest.approx(2568.3395) and bound < 2568.340  # rounded down by half a printed digit
    optimal = "Result - Optimal solution found\n\nObjective value:                12.50000000\n"
    assert _parse_cbc_log(optimal) == ("Optimal solution found", 12.5, None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_units=6), st.floats(0.3, 1.2))
def test_smallest_fitting_stage_count(problem, scale):
    from planner.solve.diagnose import smallest_fitting_stages
    profile, opts = problem
    cap = scale * min_memory_plan(profile, opts).memory_bytes
    expected = None
    for stages in range(1, profile.num_units + 1):
        other = CostOptions(**{**opts.__dict__, "pipeline_ranks": stages, "memory_cap": cap})
        if brute_memory_floor(profile, other) <= cap:
            expected = stages
            break
    assert smallest_fitting_stages(profile, CostOptions(**{**opts.__dict__, "memory_cap": cap})) == expected


def test_solver_crash_falls_back_to_the_warm_start(monkeypatch):
    import pulp

    def crash(self, solver=None, **kwargs):
        raise pulp.PulpSolverError("simulated CBC crash")

    p = big_profile(L=12)
    # a tied weight: a scenario the integer program settles (planner.solve.branch does not apply)
    p.extra["shared_parameters"] = [{"name": "tied", "units": [p.units[0].name, p.units[-1].name], "bytes": 4096}]
    opts = CostOptions(pipeline_ranks=3, global_batch=8, memory_cap=60e6)
    expected = solve_brute(p, opts)
    monkeypatch.setattr(pulp.LpProblem, "solve", crash)
    found = solve_ilp(p, opts, time_limit=1.0)
    assert found.objective >= expected.objective * (1 - 1e-12)
    assert found.bound <= expected.objective * (1 + 1e-12)  # the analytic bound is a valid bound
    assert found.status in ("optimal", "feasible")
    with pytest.raises(RuntimeError, match="crashed"):
        solve_ilp(p, opts, warm_start=False)


def test_a_highs_run_past_its_time_limit_is_stopped(monkeypatch):
    # HiGHS 1.16 looped at a program's root (an objective bound, after a restart) past its time limit
    # and its interrupt callbacks: planner solve hung for minutes with --time-limit 10. It runs in a
    # child process now, stopped past its limit; a finished run's values come back into the program
    import time

    import pulp

    from planner.solve import backends

    prob = pulp.LpProblem("small", pulp.LpMaximize)
    x, y = (prob.add_variable(n, 0, 10, cat=c) if hasattr(prob, "add_variable") else pulp.LpVariable(n, 0, 10, cat=c)
            for n, c in (("x", pulp.LpInteger), ("y", pulp.LpContinuous)))
    prob += 3 * x + 2 * y
    prob += x + y <= 7.5
    optimal, bound, ran = backends._run_highs(prob, time_limit=5.0)
    assert ran and optimal and (x.varValue, y.varValue) == (7, 0.5) and pulp.value(prob.objective) == 22
    assert prob.sol_status == pulp.LpSolutionOptimal

    def loops(*args, **kwargs):  # a HiGHS that never returns (in the child: fork copies this patch)
        while True:
            time.sleep(1)

    monkeypatch.setattr(backends, "_run_highs_here", loops)
    started = time.monotonic()
    assert backends._run_highs(prob, time_limit=0.2) == (False, None, False)
    assert time.monotonic() - started < 0.2 + backends.HIGHS_GRACE_S + 2

    def fails(*args, **kwargs):  # an error in the child is raised in the parent, as in-process
        raise ValueError("no model")

    monkeypatch.setattr(backends, "_run_highs_here", fails)
    with pytest.raises(RuntimeError, match="HiGHS failed: ValueError: no model"):
        backends._run_highs(prob, time_limit=5.0)


def test_the_program_and_the_moves_before_it_stop_at_the_deadline():
    """At a thousand units the program's rows and the perturbations' recomputation choices take
    seconds each: both stop at the search's deadline (the moves given their choice so far are kept)."""
    import time

    from planner.solve.local_search import _best_of
    from planner.solve.floors import OutOfTime
    from planner.solve.ilp import Program

    L = 6
    profile = synthetic_profile([1e-3] * L, [2e-3] * L, [1 << 20] * L, [1 << 20] * L, [1 << 10] * (L - 1), sizes=(1,))
    opts = CostOptions(pipeline_ranks=3, global_batch=4, recompute="auto", memory_cap=64 << 20)
    past = time.perf_counter() - 1
    with pytest.raises(OutOfTime):
        Program(profile, 1, opts, [0] * L, [2] * L, deadline=past)
    Program(profile, 1, opts, [0] * L, [2] * L)  # without one it is built
    moves = [[1, 3], [2, 4], [3, 5]]
    forms = set()
    first = _best_of(profile, 1, opts, moves, None, forms, math.inf, deadline=past)
    assert first is not None and first.boundaries == [1, 3]  # only the first move was given its choice
    assert _best_of(profile, 1, opts, moves, None, forms, math.inf).boundaries == [2, 4]


@pytest.mark.parametrize("schedule,ranks,virtual,recompute", [("interleaved", 2, 2, "none"), ("1f1b", 2, 1, "auto")])
def test_a_plan_the_program_takes_for_fitting_wrongly_is_cut_off_not_proposed_again(schedule, ranks, virtual,
                                                                                     recompute):
    """Rows that count too few bytes (here: every stage's held bytes at 60 %) make the program pick plans
    `evaluate` rejects; the search cuts each off (Program.exclude) and ends at brute force's optimum
    instead of proposing the same plan until its time limit."""
    from unittest import mock

    from planner.solve.ilp import Program
    from planner.solve.ilp_memory import MemoryRows
    from tests.support.synthetic import random_chain

    profile = random_chain(random.Random(0), 6, sizes=(1, 2))
    free = CostOptions(pipeline_ranks=ranks, virtual_stages=virtual, schedule=schedule, global_batch=8, bandwidth=1e9)
    peaks = sorted(max(evaluate(profile, list(cuts), 2, free).device_memory)
                   for cuts in itertools.combinations(range(1, 6), free.num_stages - 1))
    opts = free.with_(memory_cap=peaks[len(peaks) // 3], recompute=recompute)
    oracle = solve_brute(profile, opts)
    held, exclude, cut_off = MemoryRows._held, Program.exclude, []

    def counting(program, boundaries, redo):
        cut_off.append(list(boundaries))
        exclude(program, boundaries, redo)

    with program_only(), mock.patch.object(MemoryRows, "_held", lambda self, terms, g: 0.6 * held(self, terms, g)), \
            mock.patch.object(Program, "exclude", counting):
        found = solve(profile, opts)
    assert cut_off, "the rows as patched took no wrong plan: the test shows nothing"
    assert found.status == "optimal" and found.objective == pytest.approx(oracle.objective, rel=1e-9)


def test_a_scenario_evaluate_refuses_is_its_error_not_a_search_for_a_plan():
    """`evaluate` refuses this scenario whatever the split (a global batch of 3 over 2 replicas): its
    ValueError reaches the caller, where the searches took it for splits that do not fit and proved
    the scenario had no plan (a bound of infinity, "optimal")."""
    from planner.solve.backends import choose_backend
    from planner.solve.exact import solve_scenario
    from tests.support.synthetic import random_chain

    profile = random_chain(random.Random(0), 6, sizes=(1,))
    opts = CostOptions(pipeline_ranks=2, data_parallel=2, global_batch=3, bandwidth=1e9)
    with pytest.raises(ValueError, match="does not divide the global batch"):
        solve_scenario(profile, 1, opts, None, None, choose_backend(None)[0])


@pytest.mark.parametrize("time_limit", [None, 30.0])  # in this process, and in a child forked from it
def test_highs_proves_after_another_user_of_highs_in_the_process(time_limit):
    """HiGHS keeps one thread scheduler per process. Where something else in it (pulp's HiGHS at its default
    threads: the machine's) ran first, a program asking for one thread was refused, read as solved with a
    bound of 0, and `solve` said 'feasible, gap 2 %' for a plan it proves optimal in a fresh process (found
    by running tests/solve/test_ilp_memory.py before this file's neighbour, test_zero_bubble.py)."""
    from tests.solve.test_zero_bubble import _chain
    from tests.support.solvers import highs_started_elsewhere

    highs_started_elsewhere()
    opts = CostOptions(pipeline_ranks=3, global_batch=8, schedule="zb-h1", bandwidth=1e9, latency=2e-5,
                       memory_cap=1e15, recompute="auto")
    with program_only():
        found = solve(_chain(1, 6), opts, time_limit=time_limit)
    assert found.status == "optimal" and found.gap == 0.0 and found.backend == "highs"


def test_a_highs_solve_error_is_solved_by_cbc():
    """HiGHS ends some programs in its own solve error (its optimum off a row by 1.00001e-9 against its
    1e-9 tolerance) with no solution, which read as "no plan" where one fits; CBC then solves the same
    program. This 4-unit chain on 3 stages, without a cap, is one (found by test_highs_agrees_with_cbc)."""
    profile = synthetic_profile(
        [{4: 0.009084826423039571}, {4: 0.005078571217805765}, {4: 0.010189871099821803}, {4: 0.008196534159997272}],
        [{4: 0.012480266764946388}, {4: 0.008908681136935612}, {4: 0.02043502058519562}, {4: 0.0156022611398789}],
        [0, 0, 0, 0], [{4: 3198616}, {4: 2257248}, {4: 7091312}, {4: 6161508}],
        [{4: 3060348}, {4: 2360440}, {4: 0}], [{4: 0}, {4: 1180220}, {4: 0}], sizes=(4,))
    for unit in profile.units:
        unit.optimizer_s = {"sgd": 0.00075, "adamw": 0.0015}
    opts = CostOptions(pipeline_ranks=3, global_batch=16, bandwidth=1e10)
    with program_only():
        highs = assert_matches_oracle(profile, opts, backend="highs", warm_start=False)
    assert highs is not None and highs.backend == "highs"
