"""Hand-computed cost-model cases: iteration time, transfers, memory and in-flight counts."""
import math

import pytest

from planner.cost.model import candidate_micro_batch_sizes, cut_time, evaluate
from planner.cost.options import CostOptions
from tests.support.synthetic import synthetic_profile


def three_units(cut_grad=None):
    # per sample: forward 1/2/3 ms, backward 2/4/6 ms, saved 10/20/30 B, cuts 1000/2000 B
    return synthetic_profile(forward=[0.001, 0.002, 0.003], backward=[0.002, 0.004, 0.006],
                             params=[100, 200, 300], saved=[10, 20, 30], cut_act=[1000, 2000],
                             cut_grad=cut_grad, sizes=(1, 2, 4, 8))


def test_candidate_sizes_divide_the_global_batch():
    p = three_units()
    assert candidate_micro_batch_sizes(p, 12) == [1, 2, 4]
    assert candidate_micro_batch_sizes(p, 8) == [1, 2, 4, 8]
    assert candidate_micro_batch_sizes(p, 3) == [1]


def test_two_stages_1f1b_by_hand():
    p = three_units()
    opts = CostOptions(pipeline_ranks=2, global_batch=8, bandwidth=1e6, latency=1e-4)
    cost = evaluate(p, [1], 2, opts)  # b = 2, m = 4
    assert cost.num_micro_batches == 4
    # cut 1 at b=2: 2000 B forward + 2000 B gradient at 1 MB/s, two messages of 0.1 ms
    c1 = 4000 / 1e6 + 2 * 1e-4
    assert math.isclose(cut_time(p, 1, 2, opts), c1)
    s0, s1 = cost.stages
    assert (s0.first_unit, s0.end_unit, s1.first_unit, s1.end_unit) == (0, 1, 1, 3)
    assert math.isclose(s0.forward_s, 0.002) and math.isclose(s0.backward_s, 0.004)
    assert math.isclose(s1.forward_s, 0.010) and math.isclose(s1.backward_s, 0.020)
    assert math.isclose(s0.comm_s, c1) and math.isclose(s1.comm_s, c1)  # charged to both sides
    t0, t1 = 0.006 + c1, 0.030 + c1
    assert math.isclose(s0.time_s, t0) and math.isclose(s1.time_s, t1)
    iteration = t0 + t1 + 3 * t1
    assert math.isclose(cost.iteration_s, iteration) and math.isclose(cost.bottleneck_s, t1)
    assert math.isclose(cost.bubble_fraction, 1 - 4 * (t0 + t1) / (2 * iteration))
    # memory, SGD: params + grads, plus in-flight activations: stage 0 holds min(2, 4) = 2, stage 1 holds 1
    assert (s0.in_flight, s1.in_flight) == (2, 1)
    assert s0.memory_bytes == 100 * 2 + 2 * 20
    assert s1.memory_bytes == 500 * 2 + 1 * (40 + 60)
    assert cost.feasible


def test_gpipe_holds_every_micro_batch():
    p = three_units()
    cost = evaluate(p, [1], 2, CostOptions(pipeline_ranks=2, global_batch=8, schedule="gpipe"))
    assert [s.in_flight for s in cost.stages] == [4, 4]
    assert [s.memory_bytes for s in cost.stages] == [200 + 4 * 20, 1000 + 4 * 100]
    # iteration formula is the same for both schedules
    c = evaluate(p, [1], 2, CostOptions(pipeline_ranks=2, global_batch=8)).iteration_s
    assert math.isclose(cost.iteration_s, c)


def test_in_flight_capped_by_micro_batches_and_adam_state():
    p = three_units()
    opts = CostOptions(pipeline_ranks=3, global_batch=2, optimizer="adamw")
    cost = evaluate(p, [1, 2], 2, opts)  # m = 1
    assert [s.in_flight for s in cost.stages] == [1, 1, 1]
    assert cost.stages[0].optimizer_bytes == 200
    assert cost.stages[0].memory_bytes == 100 * 4 + 20
    assert cost.stages[2].memory_bytes == 300 * 4 + 60
    # m = 1: iteration = sum of stage times, no bubble term
    assert math.isclose(cost.iteration_s, sum(s.time_s for s in cost.stages))
    opts = CostOptions(pipeline_ranks=3, global_batch=16)
    assert [s.in_flight for s in evaluate(p, [1, 2], 1, opts).stages] == [3, 2, 1]


def test_memory_cap_is_inclusive():
    p = three_units()
    assert evaluate(p, [1], 2, CostOptions(pipeline_ranks=2, global_batch=8, memory_cap=1100)).feasible
    assert not evaluate(p, [1], 2, CostOptions(pipeline_ranks=2, global_batch=8, memory_cap=1099)).feasible


def test_latency_counts_messages():
    opts = CostOptions(pipeline_ranks=2, global_batch=4, bandwidth=1e6, latency=1e-3)
    no_grad = three_units(cut_grad=[0, 0])
    assert math.isclose(cut_time(no_grad, 1, 1, opts), 1000 / 1e6 + 1e-3)  # forward message only
    empty = synthetic_profile([0.001] * 2, [0.001] * 2, [0, 0], [0, 0], cut_act=[0])
    assert cut_time(empty, 1, 1, opts) == 0.0  # only a constant crosses: nothing is sent
    single = evaluate(empty, [], 1, CostOptions(pipeline_ranks=1, global_batch=4))
    assert math.isclose(single.iteration_s, 4 * 0.004) and single.bubble_fraction == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("stages,boundaries,b,match", [
    (3, [2, 1], 1, "strictly increasing"),
    (3, [1, 1], 1, "strictly increasing"),
    (2, [0], 1, "1..2"),
    (2, [3], 1, "1..2"),
    (2, [1, 2], 1, "need 1 boundaries"),
    (2, [1], 8, "does not divide"),
    (2, [1], 3, "not profiled"),
])
def test_bad_plans_are_rejected(stages, boundaries, b, match):
    opts = CostOptions(pipeline_ranks=stages, global_batch=12)
    with pytest.raises(ValueError, match=match):
        evaluate(three_units(), boundaries, b, opts)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="only 3 units"):
        evaluate(three_units(), [1, 2, 2], 1, CostOptions(pipeline_ranks=4, global_batch=4))
    with pytest.raises(ValueError, match="schedule"):
        evaluate(three_units(), [1], 1, CostOptions(pipeline_ranks=2, global_batch=4, schedule="zb"))
    with pytest.raises(ValueError, match="optimizer"):
        evaluate(three_units(), [1], 1, CostOptions(pipeline_ranks=2, global_batch=4, optimizer="lion"))


def test_every_stage_pays_the_profiles_stage_overhead_once_per_micro_batch():
    plain = three_units()
    charged = synthetic_profile(forward=[0.001, 0.002, 0.003], backward=[0.002, 0.004, 0.006],
                                params=[100, 200, 300], saved=[10, 20, 30], cut_act=[1000, 2000],
                                sizes=(1, 2, 4, 8), stage_overhead={2: (0.0005, 0.001)})
    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule="gpipe", bandwidth=1e6)
    a, b = evaluate(plain, [1], 2, opts), evaluate(charged, [1], 2, opts)
    for st_a, st_b in zip(a.stages, b.stages):
        assert st_b.forward_s == pytest.approx(st_a.forward_s + 0.0005)
        assert st_b.backward_s == pytest.approx(st_a.backward_s + 0.001)
    # (1/v) sum_c T_c + (m - 1) max_c T_c: each of the two stages is 1.5 ms longer, m = 4
    assert b.iteration_s == pytest.approx(a.iteration_s + 2 * 0.0015 + 3 * 0.0015)
    assert evaluate(charged, [1], 4, opts).iteration_s == evaluate(plain, [1], 4, opts).iteration_s  # b=4: none


def test_a_per_stage_cost_makes_every_solver_prefer_fewer_larger_micro_batches():
    """Times linear in b: without a per-stage cost the shorter fill of b = 1 wins; a cost per stage
    and micro-batch makes 2 micro-batches of 4 cheaper than 8 of 1, in every exact method."""
    from planner.solve.api import solve

    def profile(overhead):
        return synthetic_profile(forward=[1.0, 1.0], backward=[2.0, 2.0], params=[0, 0], saved=[0, 0], cut_act=[0],
                                 sizes=(1, 4), stage_overhead={b: (overhead, overhead) for b in (1, 4)})
    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule="1f1b")
    for method in ("ilp", "dp", "brute"):
        assert solve(profile(0.0), opts, method=method).micro_batch_size == 1  # 3 x (8 + 1) = 27 < 12 x 3
        chosen = solve(profile(5.0), opts, method=method)  # 13 x 9 = 117 > 22 x 3 = 66
        assert chosen.micro_batch_size == 4 and chosen.objective == pytest.approx(66.0), method
