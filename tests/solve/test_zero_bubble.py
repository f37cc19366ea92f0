"""The solver on zero-bubble schedules: the exact search equals brute force on small random chains
(both backward parts timed, memory capped, recomputation allowed), and `--schedule auto` weighs
zb-h1 and zb-v against the others on the same exact costs."""
import itertools
import random

import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.solve.api import solve
from planner.solve.brute import solve_brute
from planner.solve.scenario_bound import scenario_lower_bound
from tests.support.solvers import both_solvers_match_brute_force, program_only
from tests.support.synthetic import compute_inside, random_chain, receive_apart


def _chain(seed: int, L: int, frozen: bool = False):
    rng = random.Random(seed)
    profile = random_chain(rng, L, frozen=frozen)
    for u in profile.units:  # the parts as a profile measures them (not the estimate)
        share = rng.uniform(0.2, 0.7)
        u.backward_input_s = {b: (1 - share) * t for b, t in u.backward_s.items()}
        u.backward_weight_s = {b: share * t for b, t in u.backward_s.items()}
        u.weight_held_bytes = {b: int(s * rng.uniform(0.3, 1.2)) for b, s in u.saved_bytes.items()}
    if seed % 2 == 0:  # the kept gradients measured apart: a later stage's units hold all they saved but the last
        for u in profile.units:
            u.weight_kept_bytes = {b: int(h * rng.uniform(0.0, 0.5)) for b, h in u.weight_held_bytes.items()}
    if seed % 2 == 0:  # what the split costs a stage on top of its units (the first stage's differs)
        profile.split_overhead_s = {b: (rng.uniform(0, 1e-3), rng.uniform(0, 2e-3), rng.uniform(0, 2e-3))
                                    for b in profile.micro_batch_sizes}
    if seed % 4 != 1:  # the weight calls' walk through a stage's earlier units (quadratic in its units)
        walk = random.Random(seed + 1000)
        for u in profile.units:
            u.weight_calls, u.weight_walk_nodes = walk.randint(0, 6), walk.randint(0, 300)
        profile.weight_walk_s = {b: walk.uniform(0, 4e-5) * b for b in profile.micro_batch_sizes}
    if seed % 4 == 2:  # some units' inputs received in storages of their own (first_a)
        receive_apart(profile, [l for l in range(L) if rng.random() < 0.4], rng)
    if seed % 3 == 0:  # values a stage computes from its parameters change what units hold (inner_weight)
        compute_inside(profile, rng)
    return profile


@pytest.mark.parametrize("schedule,p", [("zb-h1", 3), ("zb-v", 2)])
@pytest.mark.parametrize("seed", [1, 2, 7])  # (4 as 2: kept gradients, a walk)
def test_solver_matches_brute_force(schedule, p, seed):
    profile = _chain(seed, 6)
    free = CostOptions(pipeline_ranks=p, global_batch=8, schedule=schedule, virtual_stages=2 if schedule == "zb-v" else 1,
                       bandwidth=1e9, latency=2e-5)
    unlimited = solve(profile, free)
    # a cap between the least and the most memory any plan of the scenario needs: memory decides too
    opts = free.with_(memory_cap=max(unlimited.cost.device_memory) * 0.9, recompute="auto")
    oracle = solve_brute(profile, opts)
    found = solve(profile, opts)
    assert oracle is not None and found.status == "optimal"
    assert found.objective == pytest.approx(oracle.objective, rel=1e-9)
    with program_only():  # the integer program on its own (the search settles chains this small)
        program = solve(profile, opts)
    assert program.status == "optimal" and program.objective == pytest.approx(oracle.objective, rel=1e-9)
    again = evaluate(profile, found.boundaries, found.micro_batch_size, found.options, found.recompute)
    assert again.feasible and again.iteration_s == pytest.approx(found.objective, rel=1e-12)
    assert all(st.backward_input_s is not None and st.backward_weight_s is not None for st in found.cost.stages)
    assert scenario_lower_bound(profile, found.micro_batch_size, found.options) <= found.objective * (1 + 1e-12)


def test_auto_weighs_the_zero_bubble_schedules():
    # equal units, free messages, many stages: the bubble decides, and zero-bubble schedules have least
    from tests.support.synthetic import synthetic_profile

    L = 8
    profile = synthetic_profile([1e-3] * L, [2e-3] * L, [1000] * L, [100] * L, [0] * (L - 1), sizes=(1, 2))
    opts = CostOptions(pipeline_ranks=4, global_batch=8, bandwidth=1e12)
    chosen = solve(profile, opts, schedules=["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"])
    assert chosen.options.schedule in ("zb-h1", "zb-v")
    one_f_one_b = solve(profile, opts)
    assert chosen.objective < one_f_one_b.objective


def test_the_weight_calls_walk_is_quadratic_in_a_stages_units():
    """walk(a, e) = sum_{a<=j<k<e} nu_j omega_k: each weight call of unit k walks the nodes of the
    stage's earlier units j; the matrices the search reads and one range's cost agree with it."""
    from planner.cost.ranges import RangeCosts

    profile = _chain(2, 7)
    costs = RangeCosts(profile, 2)
    nu = [profile.weight_walk_s[2] * u.weight_walk_nodes for u in profile.units]
    omega = [u.weight_calls for u in profile.units]
    assert any(nu) and any(omega)
    _, weight = costs.split_matrices(0.0)
    for a in range(7):
        for e in range(a + 1, 8):
            walk = sum(nu[j] * omega[k] for k in range(a, e) for j in range(a, k))
            assert costs.walk(a, e) == pytest.approx(walk, rel=1e-12, abs=1e-15)
            if a > 0:
                plain = costs.later_weight + sum(costs.gw[a:e])
                assert costs.backward_weight(a, e) == pytest.approx(plain + walk, rel=1e-12)
                assert weight[a, e] == pytest.approx(plain + walk, rel=1e-12)
    assert costs.walk(3, 4) == 0.0  # a unit alone: its own walk is in its timed weight part


@pytest.mark.parametrize("schedule,p", [("zb-h1", 3), ("zb-v", 2)])
@pytest.mark.parametrize("seed", [1, 2, 4])
def test_solvers_split_a_stage_whose_input_needs_no_gradient_as_the_first(schedule, p, seed):
    """No gradient crosses cuts 1, 2 and 4 (frozen units before them, or integer inputs): a stage starting
    there splits its backward as the first stage does, in its times and held bytes (planner.cost.ranges'
    `whole`); the branch and bound, the integer program and the scenario's bound agree with brute force."""
    profile = _chain(seed, 6)
    for k in (1, 2, 4):
        for value in profile.cut(k).values:
            value.requires_grad = False
    free = CostOptions(pipeline_ranks=p, global_batch=8, schedule=schedule, virtual_stages=2 if schedule == "zb-v" else 1,
                       bandwidth=1e9, latency=2e-5)
    unlimited = solve(profile, free)
    # caps each some split's peak (so feasible) and below the fastest's: memory decides, whole starts held more
    peaks = sorted({max(evaluate(profile, list(cuts), unlimited.micro_batch_size, free).device_memory)
                    for cuts in itertools.combinations(range(1, 6), free.num_stages - 1)})
    caps = [cap for cap in peaks if cap < max(unlimited.cost.device_memory)][-3:]
    if free.virtual_stages == 1:  # the branch and bound's stage memory is each split's, whole starts too
        from planner.solve.diagnose import memory_matrices

        b = unlimited.micro_batch_size
        matrices = memory_matrices(profile, b, free)
        for cuts in itertools.combinations(range(1, 6), p - 1):
            edges = (0, *cuts, 6)
            held = [matrices(g)[edges[g], edges[g + 1]] for g in range(p)]
            assert held == pytest.approx(evaluate(profile, list(cuts), b, free).device_memory, rel=1e-9), cuts
    for opts in (free, *(free.with_(memory_cap=cap, recompute="auto") for cap in caps)):
        oracle, found = both_solvers_match_brute_force(profile, opts)
        assert oracle is not None
        assert scenario_lower_bound(profile, found.micro_batch_size, found.options) <= found.objective * (1 + 1e-12)


@pytest.mark.parametrize("seed", [10])  # (every term of the program's rows: tests/solve/test_ilp_memory.py)
def test_solvers_count_a_stage_ending_in_frozen_units(seed):
    """A later stage whose last units train nothing (a LoRA model's norm and head) holds between its
    backward parts what its last trained unit holds timed alone (h) and their own h, not all that unit
    saved (planner.cost.ranges' trained[e]); the stage memory's rows, the integer program and the search
    agree with brute force (without the term in the program's rows, zb-v at seed 10 found no plan where
    one fits)."""
    profile = _chain(seed, 6, frozen=True)
    for l in (4, 5) if seed % 4 == 0 else (2, 5):
        profile.units[l].trainable_bytes = 0
        profile.units[l].weight_held_bytes = {b: 0 for b in profile.micro_batch_sizes}
        profile.units[l].weight_kept_bytes = {b: 0 for b in profile.micro_batch_sizes}
    assert range_costs(profile, 2).kept_known
    _memory_decides(profile)


@pytest.mark.parametrize("seed", [2])
def test_solvers_count_a_stage_first_units_inputs_as_its_weight_part_holds_them(seed):
    """A later stage whose first unit holds its h (the only one) counts that unit's inputs as received as
    its weight part holds them (first'_a, first_weight_held_bytes), not as its forward saves them
    (first_a): the stage memory's rows on every split, on a chain where they differ for every unit."""
    profile = _chain(seed, 6)
    receive_apart(profile, range(6), random.Random(seed))
    assert range_costs(profile, 2).kept_known
    _matrices_equal_evaluate(profile)  # (the program's rows: tests/solve/test_ilp_memory.py)


@pytest.mark.parametrize("seed,schedule,ranks,share", [(2, "zb-v", 2, 0.6), (26, "zb-h1", 3, 0.8), (26, "zb-v", 2, 0.8),
                                                       (38, "zb-v", 2, 0.9)])
def test_solvers_count_what_a_stage_holder_lets_go_of_what_it_shares(seed, schedule, ranks, share):
    """A zero-bubble stage's last unit (or last trained one) may let a storage it shares with the unit before
    go in its input part (d' < d^h): held once where that unit is in the stage and not recomputed, not at all
    otherwise (it starts the stage, or that unit is recomputed; `alone_shared`, both counted it held): the
    stage memory's rows on every split, and the integer program against brute force under a cap with
    recomputation (each of these cases fails without one of the program's two terms)."""
    from tests.support.synthetic import let_go

    profile = _chain(seed, 5)
    let_go(profile, range(1, 5), random.Random(seed))
    opts = CostOptions(pipeline_ranks=ranks, virtual_stages=2 if schedule == "zb-v" else 1, global_batch=8,
                       schedule=schedule, bandwidth=1e9)
    if schedule == "zb-h1":
        _matrices_equal_evaluate(profile, (ranks,))
    peak = max(solve(profile, opts, method="dp").cost.device_memory)
    oracle, _ = both_solvers_match_brute_force(profile, opts.with_(memory_cap=peak * share, recompute="auto"))
    assert oracle is not None


def _memory_decides(profile):
    """The stage memory's rows equal `evaluate` on every split of the chain (zb-h1, 2 and 3 ranks); under
    caps at splits' peaks, and recomputation, the solvers equal brute force."""
    _matrices_equal_evaluate(profile)
    # caps each some split's peak at some b: where a split fits only as counted so, the count decides (zb-v:
    # two stages a rank, the program's rows sum them)
    for free in (CostOptions(pipeline_ranks=2, global_batch=8, schedule="zb-h1", bandwidth=1e9, latency=2e-5),
                 CostOptions(pipeline_ranks=2, virtual_stages=2, global_batch=8, schedule="zb-v", bandwidth=1e9,
                             latency=2e-5)):
        splits = list(itertools.combinations(range(1, profile.num_units), free.num_stages - 1))
        peaks = sorted({max(evaluate(profile, list(cuts), b, free).device_memory)
                        for cuts in splits for b in profile.micro_batch_sizes})[::2]  # every other: time
        for opts in [free.with_(memory_cap=cap) for cap in peaks] + [free.with_(memory_cap=peaks[1], recompute="auto")]:
            oracle, _ = both_solvers_match_brute_force(profile, opts)
            assert oracle is not None, (opts.schedule, opts.memory_cap)


def _matrices_equal_evaluate(profile, ranks=(2, 3)):
    """The branch and bound's stage memory (planner.solve.diagnose.memory_matrices) equals `evaluate` on
    every split of the chain (zb-h1, these rank counts)."""
    from planner.solve.diagnose import memory_matrices

    L = profile.num_units
    for p in ranks:
        free = CostOptions(pipeline_ranks=p, global_batch=8, schedule="zb-h1", bandwidth=1e9, latency=2e-5)
        for b in profile.micro_batch_sizes:
            matrices = memory_matrices(profile, b, free)
            for cuts in itertools.combinations(range(1, L), p - 1):
                edges = (0, *cuts, L)
                held = [matrices(g)[edges[g], edges[g + 1]] for g in range(p)]
                assert held == pytest.approx(evaluate(profile, list(cuts), b, free).device_memory, rel=1e-9), cuts
