"""Replicated stages: the cost model by hand and against the simulation of the runtime's lists, the
solver against brute force (its plan's time is simulated, its bound must hold), and what it refuses."""
import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.fidelity.simulation import simulate_plan
from planner.pipeline import schedule as sched
from planner.plan.make import make_plan
from planner.solve.api import solve
from planner.solve.brute import solve_brute, solve_brute_replicated
from planner.solve.diagnose import InfeasibleError
from planner.solve.replicas import solve_replicated
from planner.solve.solution import Solution
from tests.support.synthetic import random_chain, share_saved, synthetic_profile


@pytest.fixture(autouse=True)
def the_search(monkeypatch):
    """These tests are of the fill-drain search; below ENUMERATED_PLANS plans the solver enumerates them
    all instead (test_small_problems_are_enumerated_to_the_optimum turns it back on)."""
    import planner.solve.replicas as replicas

    monkeypatch.setattr(replicas, "ENUMERATED_PLANS", 0)


def three_units():
    return synthetic_profile(forward=[0.001, 0.010, 0.001], backward=[0.002, 0.020, 0.002], params=[100, 200, 300],
                             saved=[10, 20, 30], cut_act=[1000, 2000], sizes=(1, 2, 4, 8))


def _plan(profile, boundaries, b, opts):
    cost = evaluate(profile, boundaries, b, opts)
    solution = Solution(boundaries=boundaries, micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                        cost=cost, status="fixed", objective=cost.iteration_s, bound=cost.iteration_s, gap=0.0,
                        seconds=0.0, method="fixed", backend="none", options=opts)
    return cost, make_plan(profile, solution, opts, "")


def test_replicated_stage_by_hand():
    p = three_units()
    opts = CostOptions(pipeline_ranks=4, global_batch=8, bandwidth=1e6, dp_bandwidth=1e5, replicas=(1, 2, 1))
    cost, plan = _plan(p, [1, 2], 1, opts)  # b = 1, m = 8
    t = [0.003 + 2000 / 1e6, 0.030 + 2000 / 1e6 + 4000 / 1e6, 0.003 + 4000 / 1e6]
    assert [st.time_s for st in cost.stages] == pytest.approx(t)
    assert [st.device for st in cost.stages] == [0, 1, 3] and [st.replicas for st in cost.stages] == [1, 2, 1]
    # 1f1b warm-up w_2 = r_2 - 1 = 0, w_g = w_{g+1} + max(r_g, r_{g+1}): 2, 4;
    # held ceil(min(w + 1, m) / r) = 5, ceil(3 / 2) = 2, 1
    assert [st.in_flight for st in cost.stages] == [5, 2, 1]
    # what each list holds at its fullest (1 kB / 2 kB cross the cuts at b = 1): device 0 five
    # micro-batches and a received gradient; device 1 two micro-batches, a received gradient and an
    # output it posts after that receive (planner.pipeline.pulled: the last stage asks for it later),
    # in flight while the backward runs; device 2 two micro-batches and both their outputs, posted
    # together when the last stage asks for them together; the last device three inputs received
    # from both replicas in one batch before its forward uses them
    assert cost.device_memory == [200 + 5 * 10 + 1000, 400 + 2 * 20 + 2000 + 2000, 400 + 2 * 20 + 2 * 2000,
                                  600 + 3 * 2000]
    assert cost.pipeline_ranks == 4
    # stage 1's gradients: a ring over its 2 replicas, 2 (1/2) 200 B / 1e5 B/s
    assert cost.stages[1].extra_s == pytest.approx(200 / 1e5) and cost.stages[0].extra_s == 0.0
    assert cost.iteration_s == pytest.approx(simulate_plan(plan).iteration_s, rel=1e-12)
    # every device runs its share of micro-batches: the step is at least a replica of stage 1's compute
    # (4 x 0.030) after stage 0's first forward and its activations (1 kB: 0.001 s), and before its last
    # gradient crosses back; not its compute and all its transfers (4 t[1] = 0.144 s), as the messages
    # of one batch cross together and 1f1b's lists receive several at once (0.143 s)
    assert cost.iteration_s >= 0.003 + 0.001 + 4 * 0.030 + 0.001
    gpipe = evaluate(p, [1, 2], 1, opts.with_(schedule="gpipe"))
    assert [st.in_flight for st in gpipe.stages] == [8, 4, 8]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_every_r_1_is_the_unreplicated_plan(schedule, m):
    rng = random.Random(m)
    L = 5
    p = synthetic_profile([rng.uniform(1e-3, 1e-2) for _ in range(L)], [rng.uniform(1e-3, 2e-2) for _ in range(L)],
                          [rng.randint(0, 1000) for _ in range(L)], [rng.randint(0, 100) for _ in range(L)],
                          [rng.randint(0, 5000) for _ in range(L - 1)], sizes=(1,))
    opts = CostOptions(pipeline_ranks=4, global_batch=m, schedule=schedule, data_parallel=1, bandwidth=1e6)
    plain = evaluate(p, [1, 2, 4], 1, opts)
    ones = evaluate(p, [1, 2, 4], 1, opts.with_(replicas=(1, 1, 1, 1)))
    assert ones.iteration_s == pytest.approx(plain.iteration_s, rel=1e-14)
    assert ones.device_memory == pytest.approx(plain.device_memory, rel=1e-14)
    assert [[str(a) for a in actions] for actions in sched.build_schedule(schedule, 4, m, stage_replicas=[1] * 4)] == \
        [[str(a) for a in actions] for actions in sched.build_schedule(schedule, 4, m)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("replicas,bounds,m", [((1, 2, 1), [1, 2], 8), ((2, 1), [2], 6), ((1, 3), [1], 7),
                                               ((3,), [], 5), ((1, 1, 1), [1, 2], 4), ((2, 2), [1], 8)])
def test_prediction_is_the_simulation_and_held_counts_the_lists(schedule, replicas, bounds, m):
    p = three_units()
    opts = CostOptions(pipeline_ranks=sum(replicas), global_batch=m, schedule=schedule, bandwidth=1e8,
                       replicas=replicas if max(replicas) > 1 else ())
    cost, plan = _plan(p, bounds, 1, opts)
    assert cost.iteration_s == pytest.approx(simulate_plan(plan).iteration_s, rel=1e-12)
    lists = sched.build_schedule(schedule, len(replicas), m, stage_replicas=list(replicas))  # what runs
    devices = [sched.max_in_flight(lst) for lst in lists]
    held = [max(devices[st.device:st.device + st.replicas]) for st in cost.stages]  # the busiest replica
    assert held == [st.in_flight for st in cost.stages]


@st.composite
def problems(draw):
    L = draw(st.integers(1, 6))
    N = draw(st.integers(1, 5))
    sizes = tuple(sorted(draw(st.sets(st.sampled_from((1, 2, 4)), min_size=1, max_size=3))))
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    profile = random_chain(rng, L, sizes, stage_overhead=True)
    opts = CostOptions(pipeline_ranks=N, global_batch=draw(st.sampled_from([4, 8, 16])),
                       schedule=draw(st.sampled_from(["1f1b", "gpipe"])), bandwidth=rng.choice([1e8, 1e9, 1e10]),
                       latency=rng.choice([0.0, 1e-4]), data_parallel=draw(st.sampled_from([1, 2])),
                       dp_bandwidth=rng.choice([None, 1e8]), recompute=draw(st.sampled_from(["none", "all", "auto"])),
                       step_overhead_s=rng.choice([0.0, 1e-3]), message_s=rng.choice([0.0, 5e-5]))
    if draw(st.booleans()):
        opts = opts.with_(memory_cap=rng.uniform(5e6, 6e7))
    return profile, opts


@pytest.mark.parametrize("enumerated", [False, True])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(problems())
def test_solver_equals_brute_force(enumerated, problem):
    """The search (enumeration off) and, at most ENUMERATED_PLANS plans, the enumeration, against brute force."""
    import planner.solve.replicas as replicas

    profile, opts = problem
    with pytest.MonkeyPatch.context() as patch:
        if enumerated:
            patch.setattr(replicas, "ENUMERATED_PLANS", 10**9)
        oracle = solve_brute_replicated(profile, opts)
        if oracle is None:
            with pytest.raises(InfeasibleError):
                solve_replicated(profile, opts)
            return
        # the bounded tables may miss a plan that fits only just: the exact tables of every replica tuple
        # (TupleTables) then find it, so a plan is found wherever one fits
        found = solve_replicated(profile, opts)
    if enumerated:  # every plan simulated: the exact model's optimum (the fill-drain form's is not always)
        assert found.backend == "enumeration" and found.objective == pytest.approx(oracle.objective, rel=1e-12)
        assert found.status == "optimal" and found.gap == 0.0 and found.bound == found.objective
    else:
        # the plan optimises the fill-drain form and reports its simulated time: never better than the
        # oracle, never worse than the exact one-stage-per-device plan, and the busy-time bound holds
        assert found.objective >= oracle.objective * (1 - 1e-9)
        if opts.pipeline_ranks <= profile.num_units:
            try:  # one stage per device may not fit where replicas (sharing a stage's units) do
                unreplicated = solve(profile, opts).objective
            except InfeasibleError:
                unreplicated = math.inf
            assert found.objective <= unreplicated * (1 + 1e-9)
        assert found.bound <= oracle.objective * (1 + 1e-9)
        assert found.gap == pytest.approx((found.objective - found.bound) / found.objective) or found.gap == 0.0
    cost = evaluate(profile, found.boundaries, found.micro_batch_size, found.options, found.recompute)
    assert cost.feasible and cost.iteration_s == pytest.approx(found.objective, rel=1e-12)
    assert cost.pipeline_ranks == opts.pipeline_ranks


def test_the_search_misses_what_enumeration_finds():
    # a chain where the fill-drain form's optimum is not the simulation's (found by the fuzz of
    # BENCHMARKS.md): the search's plan is slower than the enumerated one, which is the optimum
    import planner.solve.replicas as replicas

    for seed in range(40):
        rng = random.Random(seed)
        L, N = rng.randint(2, 9), rng.randint(2, 4)
        profile = random_chain(rng, L, sizes=(1, 2, 4))
        opts = CostOptions(pipeline_ranks=N, global_batch=8, schedule=rng.choice(["1f1b", "gpipe"]))
        searched = solve_replicated(profile, opts)
        if searched.objective > solve_brute_replicated(profile, opts).objective * (1 + 1e-9):
            break
    else:
        pytest.fail("no chain where the search is off the optimum")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replicas, "ENUMERATED_PLANS", 10**9)
        enumerated = solve_replicated(profile, opts)
    assert enumerated.objective < searched.objective and enumerated.status == "optimal"


def heavy_middle():
    # unit 2 is 10x the others and cannot be split: four devices, one stage each, wait on it; the
    # light units' 40 MB of parameters make replicating them (or everything) cost all-reduce time
    return synthetic_profile(forward=[0.001, 0.001, 0.010, 0.001], backward=[0.002, 0.002, 0.020, 0.002],
                             params=[40_000_000, 40_000_000, 1000, 40_000_000], saved=[100] * 4, cut_act=[1000] * 3,
                             sizes=(1, 2))


def test_replication_beats_every_unreplicated_split():
    p = heavy_middle()
    opts = CostOptions(pipeline_ranks=4, global_batch=8, bandwidth=1e9)
    replicated = solve_replicated(p, opts)
    assert replicated.options.replicas == (1, 2, 1) and replicated.boundaries == [2, 3]
    unreplicated = min(solve_brute(p, opts.with_(pipeline_ranks=S)).objective for S in range(1, 5))
    assert replicated.objective < 0.6 * unreplicated
    assert solve(p, opts).objective >= unreplicated * (1 - 1e-12)  # the ordinary solver on 4 devices


def test_unreplicated_optimum_is_kept_when_replication_does_not_pay():
    p = synthetic_profile([0.001] * 4, [0.002] * 4, [1 << 30] * 4, [10] * 4, [10] * 3, sizes=(1,))
    opts = CostOptions(pipeline_ranks=4, global_batch=8, bandwidth=1e9, dp_bandwidth=1e8)  # all-reduce is dear
    found = solve_replicated(p, opts)
    assert found.options.replicas == () and found.options.pipeline_ranks == 4
    assert found.objective == pytest.approx(solve(p, opts).objective, rel=1e-12)


def test_interleaved_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="1f1b or gpipe"):
        solve_replicated(heavy_middle(), CostOptions(pipeline_ranks=4, global_batch=8, schedule="interleaved",
                                                     virtual_stages=2))


def test_auto_recomputation_under_a_cap():
    # the heavy unit saves 4000 B per sample: no plan on 3 devices fits 7000 B without recomputing it
    p = synthetic_profile(forward=[0.001, 0.010, 0.001], backward=[0.002, 0.020, 0.002], params=[1000] * 3,
                          saved=[100, 4000, 100], cut_act=[10, 10], sizes=(1, 2))
    opts = CostOptions(pipeline_ranks=3, global_batch=8, bandwidth=1e9, memory_cap=7000, recompute="auto")
    with pytest.raises(InfeasibleError, match="allow at least"):
        solve_replicated(p, opts.with_(recompute="none"))
    found = solve_replicated(p, opts)
    oracle = solve_brute_replicated(p, opts)
    assert found.cost.feasible and found.recompute == [1] == oracle.recompute
    assert found.objective == pytest.approx(oracle.objective, rel=1e-12)  # the plan is the optimum here,
    assert found.status == "feasible" and found.gap > 0  # but the busy-time bound cannot prove it
    assert found.bound <= oracle.objective


def test_tied_parameters_and_too_few_micro_batches_are_refused():
    p = heavy_middle()
    p.extra["shared_parameters"] = [{"name": "w", "units": ["u0", "u3"], "bytes": 100}]
    with pytest.raises(ValueError, match="tied"):
        solve_replicated(p, CostOptions(pipeline_ranks=4, global_batch=8))
    with pytest.raises(ValueError, match="micro-batches cannot feed"):
        evaluate(heavy_middle(), [2], 2, CostOptions(pipeline_ranks=4, global_batch=4, replicas=(1, 3)))


def test_infeasible_says_the_least_memory():
    p = heavy_middle()
    with pytest.raises(InfeasibleError, match="allow at least") as info:
        solve_replicated(p, CostOptions(pipeline_ranks=4, global_batch=8, memory_cap=100))
    fits = solve_replicated(p, CostOptions(pipeline_ranks=4, global_batch=8, memory_cap=info.value.min_memory_bytes))
    assert max(fits.cost.device_memory) <= info.value.min_memory_bytes
    assert math.isfinite(fits.objective)


def test_1f1b_does_not_serialise_a_wide_stage_behind_a_narrow_one():
    """VGG-16's shape (a light input stage, six replicas of the convolutions, a light head). With
    the warm-up w_g = sum_{h>=g} r_h - 1 the filtered 1f1b order ran close to twice the fill-drain
    form; the runtime's rule w_g = w_{g+1} + max(r_g, r_{g+1}) keeps both well below that."""
    p = synthetic_profile(forward=[1e-4, 0.100, 0.005], backward=[2e-4, 0.200, 0.010], params=[0, 0, 0],
                          saved=[1, 1, 1], cut_act=[1000, 1000], sizes=(1,))
    for schedule in ("gpipe", "1f1b"):
        opts = CostOptions(pipeline_ranks=8, global_batch=16, schedule=schedule, bandwidth=1e9, replicas=(1, 6, 1))
        cost, _ = _plan(p, [1, 2], 1, opts)
        t = [st.time_s for st in cost.stages]
        fill_drain = sum(t) + max((math.ceil(16 / r) - 1) * x for r, x in zip((1, 6, 1), t))
        # gpipe stays near it; 1f1b's blocking batches (a replica posts its next receive only after
        # its previous compute) cost it more, but far from the 2x of a serialised order
        assert cost.iteration_s <= fill_drain * (1.08 if schedule == "gpipe" else 1.5), schedule


def test_devices_choose_the_data_parallel_degree_too():
    from planner.solve.search import expand_scenarios
    p = heavy_middle()
    opts = CostOptions(pipeline_ranks=1, global_batch=8, bandwidth=1e9)
    scenarios = expand_scenarios(opts, 10 ** 9, 4, ["1f1b", "gpipe"])
    assert {(s.pipeline_ranks, s.data_parallel) for s in scenarios} == {(4, 1), (2, 2), (1, 4)}
    found = solve_replicated(p, scenarios[0], scenarios)
    oracle = min((solve_brute_replicated(p, s) for s in scenarios), key=lambda sol: sol.objective)
    assert found.objective == pytest.approx(oracle.objective, rel=1e-12)
    assert found.options.data_parallel == oracle.options.data_parallel


def test_a_unit_with_running_statistics_is_never_replicated():
    """BatchNorm's running statistics (the profile's running_stats): replicas of its stage would
    each keep their own, and the runtime refuses such a plan, so the solver and its oracle never
    make one; the heavy unit that replication would speed up stays on one device."""
    from planner.solve.replica_tables import replicates_running_stats

    p = heavy_middle()
    p.units[2].running_stats = True
    opts = CostOptions(pipeline_ranks=4, global_batch=8, bandwidth=1e9)
    found, oracle = solve_replicated(p, opts), solve_brute_replicated(p, opts)
    for plan in (found, oracle):
        assert not replicates_running_stats(p, plan.boundaries, plan.options.replicas or (1,) * len(plan.cost.stages))
    assert found.objective == pytest.approx(oracle.objective, rel=1e-12)
    p.units[2].running_stats = False  # the light units may still be replicated
    p.units[0].running_stats = True
    assert solve_replicated(p, opts).options.replicas == (1, 2, 1)


def _fuzz_case(seed, cap):
    # the profile and options of the replicated fuzz (tests.support.synthetic), under `cap`
    rng = random.Random(seed)
    sizes = (rng.randint(1, 6), tuple(sorted(rng.sample([1, 2, 4], rng.randint(1, 3)))))
    profile = random_chain(rng, sizes[0], sizes[1], stage_overhead=rng.random() < 0.5)
    if rng.random() < 0.2:
        u = rng.choice(profile.units)
        for b in sizes[1]:
            u.forward_s[b] *= 30
            u.backward_s[b] *= 30
    N, d = rng.randint(1, 4), rng.choice([1, 1, 2])
    opts = CostOptions(pipeline_ranks=N, global_batch=rng.choice([2, 4, 8, 16]) * d, schedule=rng.choice(["1f1b", "gpipe"]),
                       bandwidth=rng.choice([1e7, 1e9, 1e10]), latency=rng.choice([0.0, 1e-4]), data_parallel=d,
                       dp_bandwidth=rng.choice([None, 1e8]), recompute=rng.choice(["none", "all", "auto"]),
                       step_overhead_s=rng.choice([0.0, 1e-3]), message_s=rng.choice([0.0, 5e-5]))
    return profile, opts.with_(memory_cap=cap)


@pytest.mark.parametrize("seed,cap", [(238, 16807740.0), (187, 25954310.0)])
def test_received_messages_are_not_summed_past_what_a_device_holds(seed, cap):
    # gpipe: a device holds an input received, or a live micro-batch, or a gradient sent, not all at once;
    # the search summed ceil(m / r) of each and found no plan where brute force fits (238: exactly at the cap)
    profile, opts = _fuzz_case(seed, cap)
    oracle = solve_brute_replicated(profile, opts)
    found = solve_replicated(profile, opts)
    assert found.cost.feasible and found.objective == pytest.approx(oracle.objective, rel=1e-12)


@pytest.mark.parametrize("seed,cap", [(2757, 20469432.0), (5156, 16821092.0), (2502, 22507878.0),
                                      (4065, 25284770.0)])
def test_a_plan_that_fits_only_under_the_exact_held_messages_is_found(seed, cap):
    # the first stage holds ceil(m / r) live micro-batches and one message (sent or received) beside
    # them; the tables bound a message per live micro-batch (over every tuple the stage may sit in),
    # the relaxation none, and its plan does not fit: the exact tables of each tuple find the one
    # that does (2757, 5156: gpipe, recompute all; 2502: gpipe auto; 4065: 1f1b auto)
    profile, opts = _fuzz_case(seed, cap)
    oracle = solve_brute_replicated(profile, opts)
    found = solve_replicated(profile, opts)
    assert found.cost.feasible and found.objective == pytest.approx(oracle.objective, rel=1e-12)


def shared_output():
    # u0 saves 1000 B per sample, 900 of them its output, which u1 saves as its input (one storage):
    # recomputing u0 inside a stage with u1 frees 100 B, not 1000; recomputing u1 frees 3000 - 900
    p = synthetic_profile(forward=[0.001, 0.002], backward=[0.002, 0.004], params=[1000, 1000],
                          saved=[1000, 3000], cut_act=[900], sizes=(1,))
    share_saved(p, [1])
    return p


def test_recomputation_frees_what_the_model_counts_with_shared_storages():
    from planner.cost.ranges import range_costs
    from planner.solve.chain_recompute import freed_bytes

    p = shared_output()
    costs = range_costs(p, 1)
    assert list(freed_bytes(costs, 0, 2)) == [100, 2100] and list(freed_bytes(costs, 0, 1)) == [1000]
    for redo in ([0], [1], [0, 1]):  # additive, as the model counts a stage's saved bytes
        assert costs.saved(0, 2) - costs.saved(0, 2, redo) == sum(freed_bytes(costs, 0, 2)[redo])
    # one stage on 3 devices (gpipe: 2 micro-batches each, 6200 B of activations): only recomputing
    # the dearer u1 fits; the tables counted 2000 B freed by u0 and the plan they chose did not fit
    opts = CostOptions(pipeline_ranks=3, global_batch=6, schedule="gpipe", bandwidth=1e9, recompute="auto")
    plain = evaluate(p, [], 1, opts.with_(replicas=(3,)))
    opts = opts.with_(memory_cap=plain.device_memory[0] - 1500)
    oracle = solve_brute_replicated(p, opts)
    found = solve_replicated(p, opts)
    assert oracle.recompute == [1] and found.cost.feasible and found.recompute == [1]
    assert found.objective == pytest.approx(oracle.objective, rel=1e-12)


# every split of 3 units into S stages and every way to spread 4 devices over them
_LAYOUTS = [(cuts, reps) for cuts in ([], [1], [2], [1, 2])
            for reps in itertools.product(range(1, 5), repeat=len(cuts) + 1) if sum(reps) == 4]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_upper_tables_bound_the_exact_memory(schedule):
    # the search's memory tables under 'upper' (every plan it accepts fits) are never below what
    # the exact model says a stage's devices hold
    from planner.cost.model import compute_profile, fixed_bytes
    from planner.solve.replica_tables import ReplicaTables, TupleTables

    rng = random.Random(5)
    for _ in range(6):
        profile = compute_profile(random_chain(rng, 3, (1, 2)), CostOptions(pipeline_ranks=4, global_batch=8))
        opts = CostOptions(pipeline_ranks=4, global_batch=8, schedule=schedule, bandwidth=1e9)
        for b in (1, 2):
            tables = ReplicaTables(profile, b, opts, 4)
            for cuts, reps in _LAYOUTS:
                if max(reps) > tables.m:
                    continue
                cost = evaluate(profile, cuts, b, opts.with_(replicas=reps if max(reps) > 1 else ()))
                edges = [0, *cuts, 3]
                for g, (a, e, r) in enumerate(zip(edges, edges[1:], reps)):
                    bound = tables.memory[tables.held[r, sum(reps[g:])], r][a, e] + fixed_bytes(profile, opts)
                    first = sum(reps[:g])
                    assert max(cost.device_memory[first:first + r]) <= bound * (1 + 1e-12)
                    exact = TupleTables(profile, b, opts, reps)  # one tuple's tables: the model's memory
                    mine = exact.memory[exact.held[r, sum(reps[g:])], r][a, e] + fixed_bytes(profile, opts)
                    assert max(cost.device_memory[first:first + r]) == pytest.approx(mine, rel=1e-12)


def test_the_plan_is_polished_by_the_exact_model(monkeypatch):
    # 20 units on 5 devices, 1f1b: the fill-drain form's optimum (stages of 1 and 4 devices) simulates 4 %
    # slower than a plan one move away; the polished plan is simulated, fits and is that much faster
    import planner.solve.replica_polish as replica_polish

    rng = random.Random(7)
    L, N = rng.randint(10, 30), rng.randint(4, 8)
    profile = random_chain(rng, L, sizes=(1, 2, 4))
    opts = CostOptions(pipeline_ranks=N, global_batch=16, schedule=rng.choice(["1f1b", "gpipe"]))
    polished = solve_replicated(profile, opts)
    monkeypatch.setattr(replica_polish, "POLISH_ROUNDS", 0)
    searched = solve_replicated(profile, opts)
    assert (L, N, opts.schedule) == (20, 5, "1f1b")
    assert polished.objective < searched.objective * 0.99
    cost = evaluate(profile, polished.boundaries, polished.micro_batch_size, polished.options, polished.recompute)
    assert cost.feasible and cost.iteration_s == pytest.approx(polished.objective, rel=1e-12)
    assert polished.bound <= polished.objective and sum(polished.options.replicas or (1,) * N) == N


def test_counting_plans_does_not_list_the_recomputation_sets():
    # --recompute auto under a cap: 2^L recomputation sets per split; 100 units counted, never listed (it
    # took all the host's memory), and --method brute refuses such a profile in one line
    from planner.solve.brute import replicated_plan_count

    profile = random_chain(random.Random(0), 100, sizes=(1,))
    opts = CostOptions(pipeline_ranks=4, global_batch=4, memory_cap=1e3, recompute="auto")
    assert replicated_plan_count(profile, opts, limit=2_000) > 2_000
    with pytest.raises(ValueError, match="brute force would evaluate"):
        solve_brute(profile, opts.with_(pipeline_ranks=2))


def test_no_plan_is_said_without_searching_every_tuple():
    # 1,000 bytes per device: not even the relaxed tables (the least held counts, no messages) have a plan,
    # so no replica tuple is searched with its exact memory (each one's tables cost L^2 and its lists)
    import planner.solve.replicas as replicas

    profile = random_chain(random.Random(0), 40, sizes=(1, 2))
    opts = CostOptions(pipeline_ranks=6, global_batch=16, memory_cap=1e3, recompute="auto")
    built = []
    original = replicas.TupleTables

    class Counted(original):
        def __init__(self, *args, **kwargs):
            built.append(args[-1])
            super().__init__(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replicas, "TupleTables", Counted)
        with pytest.raises(InfeasibleError):
            solve_replicated(profile, opts)
    assert built == []


@pytest.mark.parametrize("seed,cap", [(2757, 20469432.0), (4065, 25284770.0)])
def test_tuples_too_many_to_search_are_not_said_infeasible(monkeypatch, seed, cap):
    # the bounded tables find no plan and only the exact tables of each replica tuple find the one that
    # fits (as in the test above); with more tuples than MAX_TUPLES none is searched, and the solve said
    # "infeasible" (with a least memory above the cap the plan fits in): now one line that none was found
    # and none proven impossible, and what to do
    import planner.solve.replicas as replicas
    from planner.solve.diagnose import NoPlanInTime

    profile, opts = _fuzz_case(seed, cap)
    assert solve_brute_replicated(profile, opts).cost.feasible
    monkeypatch.setattr(replicas, "MAX_TUPLES", 1)
    with pytest.raises(NoPlanInTime) as refused:
        solve_replicated(profile, opts)
    said = str(refused.value)
    assert not isinstance(refused.value, InfeasibleError) and "\n" not in said
    assert "too many to search exhaustively (at most 1)" in said and "none proven impossible" in said
    assert "allow more memory per device" in said


def test_replicate_takes_shard_auto_on_one_replica(tmp_path, capsys):
    # `solve --stages N --replicate --shard auto` (no --devices: d = 1, so shard none): before the fix its
    # scenarios kept shard 'auto' and the cost model refused it ("cost a plan with a concrete shard");
    # seeds 2051 and 2286 of the brute-force CLI fuzz (/tmp/brute29/clifuzz.py)
    from planner.cli.main import main
    from planner.profile.profile import save_profile

    path = str(tmp_path / "profile.json")
    save_profile(three_units(), path)
    rc = main(["solve", path, "--stages", "3", "--global-batch", "8", "--replicate", "--shard", "auto",
               "--quiet", "-o", str(tmp_path / "plan.json")])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("replicas", [(2,), (1, 2), (2, 1), (3,), (1, 3), (2, 2), (1, 1, 2)])
def test_the_scenario_bound_holds_for_replicated_stages(schedule, replicas):
    """scenario_lower_bound of a scenario with replicated stages: a stage on r_g devices runs ceil(m / r_g)
    micro-batches on its busiest one, not m. Counting m, one stage on two devices was bound at twice
    its only plan's step (and (1, 2) above the best split's)."""
    from planner.solve.scenario_bound import scenario_lower_bound

    S = len(replicas)
    for L, m, seed in ((S, 4, 0), (S + 1, 5, 1), (S + 2, 7, 2)):
        profile = random_chain(random.Random(seed), L, sizes=(1,))
        opts = CostOptions(pipeline_ranks=sum(replicas), global_batch=m, schedule=schedule, replicas=replicas,
                           bandwidth=1e8, message_s=1e-4, optimizer="sgd")
        best = min(evaluate(profile, list(cuts), 1, opts).iteration_s
                   for cuts in itertools.combinations(range(1, L), S - 1))
        assert scenario_lower_bound(profile, 1, opts) <= best * (1 + 1e-12), (L, m)
    one = synthetic_profile([1e-3] * 2, [2e-3] * 2, [0] * 2, [0] * 2, [0], sizes=(1,))
    opts = CostOptions(pipeline_ranks=2, global_batch=4, schedule=schedule, replicas=(2,), optimizer="sgd")
    assert scenario_lower_bound(one, 1, opts) == pytest.approx(evaluate(one, [], 1, opts).iteration_s)  # 12 ms


def test_the_scenario_bound_lets_a_replicated_stage_fit_as_its_replicas_shard():
    """One stage on three devices sharding its parameters (ZeRO-3 over its replicas) fits a cap that the
    whole stage on one device does not: the scenario bound said no split fits (+inf) where one does."""
    from planner.solve.scenario_bound import scenario_lower_bound

    profile = synthetic_profile([1e-3] * 2, [2e-3] * 2, [8 << 20] * 2, [1 << 20] * 2, [1 << 10], sizes=(1,))
    opts = CostOptions(pipeline_ranks=3, global_batch=4, schedule="1f1b", replicas=(3,), shard="parameters",
                       optimizer="adamw")
    plan = evaluate(profile, [], 1, opts.with_(memory_cap=max(evaluate(profile, [], 1, opts).device_memory)))
    assert plan.feasible
    capped = opts.with_(memory_cap=max(plan.device_memory))
    assert scenario_lower_bound(profile, 1, capped) <= plan.iteration_s * (1 + 1e-12)


TIME_MARGIN = lambda limit: max(1.0, 0.2 * limit)  # noqa: E731  (docs/solve.md, "Replicated stages")


def _valid(profile, found, opts):
    """The plan is its simulation, fits, uses the N devices, and its bound and gap are the certificate's."""
    cost = evaluate(profile, found.boundaries, found.micro_batch_size, found.options, found.recompute)
    assert cost.feasible and cost.iteration_s == pytest.approx(found.objective, rel=1e-12)
    assert sum(found.options.replicas or (1,) * opts.pipeline_ranks) == opts.pipeline_ranks
    assert 0 < found.bound <= found.objective
    assert found.gap == pytest.approx((found.objective - found.bound) / found.objective, abs=1e-12)
    assert (found.status == "optimal") == (found.gap <= 1e-6)


def test_replicate_keeps_its_time_limit_on_a_long_chain(tmp_path, capsys):
    # 300 units on 8 devices (3 micro-batch sizes): the whole search takes minutes (the fill-drain form's
    # branch and bound, one O(N^2 L^2) DP a step, on PipeDream's nasnetalarge still running after 620 s);
    # --time-limit 2 bounds the solve and the command, and the plan is the best found with the busy-time bound
    from planner.cli.main import main
    from planner.profile.profile import save_profile
    import json
    import time

    profile = random_chain(random.Random(0), 300)
    opts = CostOptions(pipeline_ranks=8, global_batch=64)
    started = time.perf_counter()
    found = solve_replicated(profile, opts, time_limit=2.0)
    assert time.perf_counter() - started <= 2.0 + TIME_MARGIN(2.0)
    _valid(profile, found, opts)
    assert found.status == "feasible"  # stopped: the bound does not meet the plan, so no optimum is claimed
    # under a cap with --recompute auto: the recomputation tables (O(L^3) each) stop at the limit too
    capped = opts.with_(memory_cap=1.5e9, recompute="auto")
    started = time.perf_counter()
    found = solve_replicated(profile, capped, time_limit=2.0)
    assert time.perf_counter() - started <= 2.0 + TIME_MARGIN(2.0)
    _valid(profile, found, capped)
    path, out = str(tmp_path / "chain.json"), str(tmp_path / "plan.json")
    save_profile(profile, path)
    started = time.perf_counter()
    rc = main(["solve", path, "--stages", "8", "--replicate", "--global-batch", "64", "--time-limit", "2",
               "--quiet", "-o", out])
    assert time.perf_counter() - started <= 2.0 + TIME_MARGIN(2.0)
    assert rc == 0, capsys.readouterr().err
    with open(out) as f:
        plan = json.load(f)
    assert plan["solver"]["status"] == "feasible" and 0 < plan["solver"]["bound"] <= plan["solver"]["objective"]


def test_a_search_cut_short_keeps_a_plan_and_the_true_bound():
    # a limit too short for any table (L = 120): one stage on every device, or the unreplicated
    # search's plan, is kept, polished within the limit, and its gap is against the busy-time bound
    from planner.solve.replicas import busy_bound

    profile = random_chain(random.Random(3), 120, sizes=(1, 2))
    for cap in (None, 5e8):  # one stage on every device; the unreplicated plan
        opts = CostOptions(pipeline_ranks=6, global_batch=32, memory_cap=cap)
        found = solve_replicated(profile, opts, time_limit=1e-3)
        _valid(profile, found, opts)
        least = min(busy_bound(profile, b, opts) for b in (1, 2))
        assert found.bound == pytest.approx(min(least, found.objective), rel=1e-12)


def test_small_problems_stopped_in_their_enumeration_keep_the_best_so_far(monkeypatch):
    import planner.solve.replicas as replicas

    monkeypatch.setattr(replicas, "ENUMERATED_PLANS", 2_000)
    profile = random_chain(random.Random(1), 6, sizes=(1, 2))
    opts = CostOptions(pipeline_ranks=4, global_batch=8)
    whole = solve_replicated(profile, opts)
    assert whole.backend == "enumeration" and whole.status == "optimal"
    stopped = solve_replicated(profile, opts, time_limit=1e-9)  # the first plan that fits, then stopped
    assert stopped.backend == "enumeration" and stopped.objective >= whole.objective
    _valid(profile, stopped, opts)
    assert stopped.bound <= whole.objective  # the busy-time bound, not the enumeration's own word
    # ... and it did stop: the bound is the busy time's (the complete enumeration's is its optimum), no optimum claimed
    least = min(replicas.busy_bound(profile, b, opts) for b in (1, 2))
    assert least < whole.objective and stopped.bound == pytest.approx(least, rel=1e-12)
    assert stopped.status == "feasible"


def test_no_plan_found_in_time_is_said_in_one_line(tmp_path, capsys, monkeypatch):
    # nothing found before the limit and nothing proven not to fit (here: the unreplicated search stopped
    # with nothing, the closed form's tables not built, one stage on every device over the cap): not
    # "infeasible", but one line asking for more time, exit 2
    from planner.cli.main import main
    from planner.profile.profile import save_profile
    import planner.solve.replicas as replicas

    monkeypatch.setattr(replicas, "_unreplicated", lambda *args, **kwargs: (None, False))
    path = str(tmp_path / "chain.json")
    save_profile(random_chain(random.Random(0), 300), path)
    rc = main(["solve", path, "--stages", "8", "--replicate", "--global-batch", "64", "--time-limit", "0.001",
               "--memory-per-device", "800MB", "--quiet", "-o", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "plan.json").exists()
    assert err.strip().splitlines() == ["error: no replicated plan found within the time limit of 0.001 s, and none "
                                        "proven impossible either; allow more time (--time-limit)"]
