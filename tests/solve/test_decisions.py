"""Each joint decision changes the answer exactly when it should: recomputation, p x d, schedules,
a slow link in a cluster, tied parameters. ILP answers are checked against brute force."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cost.cluster import cluster_from_json
from planner.cost.model import evaluate, held_counts
from planner.cost.options import CostOptions
from planner.solve.api import solve
from planner.solve.diagnose import InfeasibleError
from tests.support.synthetic import synthetic_profile


def chain(L=6, saved=4 << 20, params=1 << 20, act=1 << 16, **kw):
    return synthetic_profile([0.002 + 0.0005 * (i % 3) for i in range(L)], [0.004 + 0.001 * (i % 2) for i in range(L)],
                             [params] * L, [saved] * L, [act] * (L - 1), sizes=(1, 2), **kw)


def same_as_brute(profile, opts, **kw):
    ilp = solve(profile, opts, **kw)
    brute = solve(profile, opts, method="brute", **kw)
    assert ilp.objective == pytest.approx(brute.objective, rel=1e-6) and ilp.status == "optimal"
    return ilp


def test_recompute_exactly_when_memory_binds():
    p = chain()
    base = CostOptions(pipeline_ranks=2, global_batch=8, schedule="gpipe", recompute="auto")
    free = same_as_brute(p, base)
    assert free.recompute == []  # no cap: recomputation only costs time
    peak = max(free.cost.device_memory)
    roomy = same_as_brute(p, base.with_(memory_cap=peak))
    assert roomy.recompute == [] and roomy.objective == pytest.approx(free.objective)
    floor_without = solve(p, base.with_(recompute="none"), method="brute").cost
    tight = base.with_(memory_cap=0.6 * peak)
    with pytest.raises(InfeasibleError):
        solve(p, tight.with_(recompute="none"))
    chosen = same_as_brute(p, tight)
    assert chosen.recompute, "memory binds: some unit must be recomputed"
    assert chosen.recompute != list(range(p.num_units)), "recomputing everything is wasteful here"
    assert all(m <= tight.memory_cap for m in chosen.cost.device_memory)
    assert chosen.objective > floor_without.iteration_s  # it pays the forward again
    every = solve(p, tight.with_(recompute="all"))
    assert every.recompute == list(range(p.num_units)) and every.objective > chosen.objective


def test_recompute_auto_without_a_cap_searches_as_none():
    # the CLI's default: --recompute auto with no memory cap went to the integer program (per-unit
    # choices) where the branch and bound over splits takes it, and ended 16 % slower at a 52 % gap
    p = chain(L=9)
    auto = solve(p, CostOptions(pipeline_ranks=3, global_batch=8, recompute="auto"))
    none = solve(p, CostOptions(pipeline_ranks=3, global_batch=8, recompute="none"))
    assert auto.backend == none.backend == "branch-and-bound" and auto.status == "optimal"
    assert auto.boundaries == none.boundaries and auto.objective == none.objective
    assert auto.recompute == []
    capped = CostOptions(pipeline_ranks=3, global_batch=8, recompute="auto", memory_cap=3 * (4 << 20) + (8 << 20))
    assert solve(p, capped).backend != "branch-and-bound"  # a cap: per-unit recomputation is chosen


def test_devices_choose_depth_and_replicas():
    # heavy parameters over a slow all-reduce: a deep pipeline (d = 1) wins
    heavy = synthetic_profile([0.01] * 8, [0.02] * 8, [256 << 20] * 8, [1 << 10] * 8, [1 << 10] * 7, sizes=(1, 2))
    opts = CostOptions(pipeline_ranks=1, global_batch=16, dp_bandwidth=1e9)
    deep = same_as_brute(heavy, opts, devices=4)
    assert (deep.cost.pipeline_ranks, deep.cost.data_parallel) == (4, 1)
    # no parameters and huge activations crossing every cut: pure data parallelism wins
    light = synthetic_profile([0.01] * 8, [0.02] * 8, [0] * 8, [1 << 10] * 8, [256 << 20] * 7, sizes=(1, 2))
    wide = same_as_brute(light, opts, devices=4)
    assert (wide.cost.pipeline_ranks, wide.cost.data_parallel) == (1, 4)
    assert wide.num_micro_batches * wide.micro_batch_size * 4 == 16
    ar = evaluate(heavy, [2], 2, opts.with_(pipeline_ranks=2, data_parallel=2))
    assert ar.stages[0].extra_s == pytest.approx(2 * 0.5 * (2 * (256 << 20)) / 1e9)


def test_slow_link_pulls_the_cut_to_the_fewest_bytes():
    # four equal units; cut 2 (balanced) carries 64 MiB, cut 1 only 1 KiB
    p = synthetic_profile([0.01] * 4, [0.02] * 4, [0] * 4, [0] * 4, [1 << 10, 64 << 20, 64 << 20], sizes=(1,))
    fast = solve(p, CostOptions(pipeline_ranks=2, global_batch=8, bandwidth=1e12))
    assert fast.boundaries == [2]
    cluster = cluster_from_json({"groups": [{"devices": 1}, {"devices": 1}],
                                 "links": [{"bandwidth": "100MB", "latency": 0.001}]})
    slow = same_as_brute(p, CostOptions(pipeline_ranks=2, global_batch=8, bandwidth=1e12, cluster=cluster))
    assert slow.boundaries == [1]


def test_cluster_speed_and_memory_per_group():
    p = synthetic_profile([0.01] * 6, [0.02] * 6, [1 << 20] * 6, [0] * 6, [0] * 5, sizes=(1,))
    cluster = cluster_from_json({"groups": [{"devices": 1, "speed": 2.0}, {"devices": 1, "speed": 1.0}],
                                 "links": [{"bandwidth": 1e12}]})
    found = same_as_brute(p, CostOptions(pipeline_ranks=2, global_batch=4, cluster=cluster))
    assert found.boundaries == [4]  # the twice-as-fast device takes twice the units
    small = cluster_from_json({"groups": [{"devices": 1, "speed": 2.0, "memory": 6 << 20}, {"devices": 1}],
                               "links": [{"bandwidth": 1e12}]})
    capped = same_as_brute(p, CostOptions(pipeline_ranks=2, global_batch=4, cluster=small))
    assert capped.boundaries == [3]  # 3 units x 2 MiB (params + grads) fill the 6 MiB device
    with pytest.raises(ValueError, match="links"):
        cluster_from_json({"groups": [{"devices": 1}, {"devices": 1}], "links": []})


def test_tied_parameters_exchange_gradients():
    p = chain(L=5, names=["embed", "b0", "b1", "b2", "head"])
    p.extra["shared_parameters"] = [{"name": "wte", "units": ["embed", "head"], "bytes": 64 << 20}]
    opts = CostOptions(pipeline_ranks=2, global_batch=4, bandwidth=1e9)
    cost = evaluate(p, [2], 2, opts)
    exchange = (64 << 20) / 1e9  # a ring all-reduce over n = 2 ranks sends 2 (n - 1) / n = 1 times the bytes
    assert [st.extra_s for st in cost.stages] == pytest.approx([exchange, exchange])
    untied = evaluate(p.__class__(**{**p.__dict__, "extra": {}}), [2], 2, opts)
    assert cost.iteration_s == pytest.approx(untied.iteration_s + exchange)
    same_as_brute(p, opts)
    same_as_brute(p, opts.with_(pipeline_ranks=3))
    one_stage = evaluate(p, [], 2, opts.with_(pipeline_ranks=1))
    assert one_stage.extra_s == 0.0


def test_interleaved_in_flight_is_what_the_lists_hold():
    # p = 2, v = 2, m = 4: rank 0 warms up 2(p-1) + (v-1)p = 4 forwards (stages 0 and 2, two each),
    # then alternates; stage 0 holds its micro-batches 0..3 when its first backward runs
    interleaved = CostOptions(pipeline_ranks=2, global_batch=4, schedule="interleaved", virtual_stages=2)
    assert held_counts(interleaved, 4) == [4, 3, 2, 1]
    assert held_counts(interleaved.with_(schedule="bfs"), 4) == [4, 4, 4, 4]
    p = chain(L=8)
    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule="interleaved", virtual_stages=2)
    cost = evaluate(p, [2, 4, 6], 1, opts)
    assert [st.device for st in cost.stages] == [0, 1, 0, 1]
    held = held_counts(opts, 8)
    # rank 0 holds at least its two stages' parameters, gradients and their held micro-batches
    static = 2 * 2 * (2 * (1 << 20))
    assert cost.device_memory[0] >= static + max(held[0], held[2]) * 2 * (4 << 20)
    work = [st.forward_s + st.backward_s for st in cost.stages]
    assert cost.iteration_s >= 8 * max(work[0] + work[2], work[1] + work[3])  # the busiest rank's work
    with pytest.raises(ValueError, match="multiple"):
        evaluate(p, [2, 4, 6], 1, opts.with_(global_batch=3))


@pytest.mark.parametrize("schedule", ["interleaved", "bfs"])
def test_multi_stage_schedules_match_brute_force(schedule):
    p = chain(L=7)
    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule=schedule, virtual_stages=2)
    same_as_brute(p, opts)
    capped = opts.with_(memory_cap=0.8 * max(solve(p, opts).cost.device_memory), recompute="auto")
    same_as_brute(p, capped)


def test_auto_schedule_picks_the_fastest():
    p = chain(L=8)
    base = CostOptions(pipeline_ranks=2, global_batch=8)
    opts = base.with_(memory_cap=max(solve(p, base).cost.device_memory))  # fits 1f1b, binds gpipe/bfs
    schedules = ["1f1b", "gpipe", "interleaved", "bfs"]
    best = same_as_brute(p, opts, schedules=schedules)
    each = []
    for s in schedules:
        try:
            each.append(solve(p, opts, method="brute", schedules=[s]).objective)
        except InfeasibleError:
            pass
    assert best.objective == pytest.approx(min(each)) and len(each) >= 2


@st.composite
def multi_stage_cluster_problems(draw):
    """Chunked schedules (v = 2) on two devices of drawn speeds, with a per-stage call cost k that
    every stage pays: 2p stages pay it, so the oracle and the ILP must both count it per stage."""
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    L = draw(st.integers(4, 7))
    sizes = (1, 2)
    forward = [{b: rng.uniform(1e-3, 5e-3) * b for b in sizes} for _ in range(L)]
    backward = [{b: rng.uniform(2e-3, 1e-2) * b for b in sizes} for _ in range(L)]
    overhead = {b: (rng.uniform(0, 4e-3), rng.uniform(0, 6e-3)) for b in sizes}
    p = synthetic_profile(forward, backward, [rng.randint(0, 4 << 20) for _ in range(L)],
                          [rng.randint(0, 2 << 20) for _ in range(L)],
                          [rng.choice([0, 1 << 16, 1 << 20]) for _ in range(L - 1)], sizes=sizes,
                          stage_overhead=overhead)
    speeds = draw(st.sampled_from([(1.0, 1.0), (2.0, 1.0), (1.0, 3.0)]))
    cluster = cluster_from_json({"groups": [{"devices": 1, "speed": speeds[0]}, {"devices": 1, "speed": speeds[1]}],
                                 "links": [{"bandwidth": rng.choice([1e8, 1e10]), "latency": 1e-4}]})
    schedule = draw(st.sampled_from(["interleaved", "bfs"]))
    return p, CostOptions(pipeline_ranks=2, global_batch=8, schedule=schedule, virtual_stages=2, cluster=cluster)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(multi_stage_cluster_problems())
def test_multi_stage_schedules_on_a_cluster_with_call_cost_match_brute_force(problem):
    p, opts = problem
    found = same_as_brute(p, opts)
    cost = evaluate(p, found.boundaries, found.micro_batch_size, opts, found.recompute)
    k = sum(p.stage_overhead(found.micro_batch_size))
    speeds = [g.speed for g in opts.cluster.groups]
    # every one of the 2p stages pays k at its device's speed
    for stage in cost.stages:
        units = p.units[stage.first_unit:stage.end_unit]
        work = sum(u.forward_s[cost.micro_batch_size] + u.backward_s[cost.micro_batch_size] for u in units)
        assert stage.forward_s + stage.backward_s == pytest.approx((k + work) / speeds[stage.device])
