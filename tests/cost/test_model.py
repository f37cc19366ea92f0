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
    """The step is the replay of the lists below with blocking batches (a batch's operations complete
    at max(post, peer's post) + transfer; a batch of sends only is posted and the rank goes on),
    checked by hand:

        rank 0: 0F0 [send F0] 0F1 [send F1] [recv B0] 0B0 0F2 [send F2, recv B1] 0B1 ... 0B3
        rank 1: [recv F0] 1F0 [recv F1] 1B0 [send B0] 1F1 1B1 [recv F2, send B1] ... 1B3 [send B3]
    """
    from planner.pipeline.schedule import build_schedule

    p = three_units()
    opts = CostOptions(pipeline_ranks=2, global_batch=8, bandwidth=1e6, latency=1e-4)
    cost = evaluate(p, [1], 2, opts)  # b = 2, m = 4
    assert cost.num_micro_batches == 4
    assert [" ".join(map(str, actions)) for actions in build_schedule("1f1b", 2, 4)] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 0SEND_F3 0RECV_B2 0B2 0RECV_B3 0B3 STEP",
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1RECV_F2 1SEND_B1 1F2 1B2 1RECV_F3 1SEND_B2 1F3 1B3 1SEND_B3 "
        "STEP"]
    # cut 1 at b=2: 2000 B each way at 1 MB/s plus 0.1 ms latency per message
    c = 2000 / 1e6 + 1e-4
    assert math.isclose(cut_time(p, 1, 2, opts), 2 * c)
    s0, s1 = cost.stages
    assert (s0.first_unit, s0.end_unit, s1.first_unit, s1.end_unit) == (0, 1, 1, 3)
    f0, b0, f1, b1 = 0.002, 0.004, 0.010, 0.020
    assert math.isclose(s0.forward_s, f0) and math.isclose(s0.backward_s, b0)
    assert math.isclose(s1.forward_s, f1) and math.isclose(s1.backward_s, b1)
    assert math.isclose(s0.comm_s, 2 * c) and math.isclose(s1.comm_s, 2 * c)  # both directions, both sides
    # rank 1 starts F0 once F0 arrived, receives F1 alone (it was sent while F0 ran), posts B0 alone
    # and goes on (B0 crosses while F1 runs); then three rounds of F, B and a batch whose two
    # messages cross at once; rank 0 ends with B3
    step = (f0 + c) + f1 + c + b1 + 3 * (f1 + b1 + c) + b0
    assert math.isclose(cost.iteration_s, step)
    assert math.isclose(cost.bubble_fraction, 1 - 4 * (f0 + b0 + f1 + b1) / (2 * step))
    # memory, SGD: params + grads + the peak of what each list holds. Rank 0 holds two micro-batches'
    # saved bytes (20 B each at b=2) and B0's received gradient (2000 B); rank 1 a received F1
    # (2000 B) while B0's gradients (2000 B), posted alone, are not yet waited for (F1 runs meanwhile).
    assert (s0.in_flight, s1.in_flight) == (2, 1)
    assert cost.device_memory == [100 * 2 + 2 * 20 + 2000, 500 * 2 + 2000 + 2000]
    assert cost.feasible


def test_gpipe_holds_every_micro_batch():
    p = three_units()
    cost = evaluate(p, [1], 2, CostOptions(pipeline_ranks=2, global_batch=8, schedule="gpipe"))
    assert [s.in_flight for s in cost.stages] == [4, 4]
    # rank 0: 4 micro-batches + a received gradient; rank 1: the larger of 3 micro-batches + the
    # received fourth input, and 4 micro-batches
    assert cost.device_memory == [200 + 4 * 20 + 2000, 1000 + max(3 * 100 + 2000, 4 * 100)]
    one_f_one_b = evaluate(p, [1], 2, CostOptions(pipeline_ranks=2, global_batch=8))
    assert cost.device_memory[0] > one_f_one_b.device_memory[0]


def test_in_flight_capped_by_micro_batches_and_adam_state():
    p = three_units()
    opts = CostOptions(pipeline_ranks=3, global_batch=2, optimizer="adamw")
    cost = evaluate(p, [1, 2], 2, opts)  # m = 1
    assert [s.in_flight for s in cost.stages] == [1, 1, 1]
    assert cost.stages[0].optimizer_bytes == 200
    # a received activation is held until its forward consumes it, a received gradient until backward
    assert cost.device_memory == [100 * 4 + 20 + 2000, 200 * 4 + 40 + 4000, 300 * 4 + max(4000, 60)]
    # m = 1: iteration = every compute and every message once, nothing overlaps
    work = sum(s.forward_s + s.backward_s for s in cost.stages)
    assert math.isclose(cost.iteration_s, work + cut_time(p, 1, 2, opts) + cut_time(p, 2, 2, opts))
    opts = CostOptions(pipeline_ranks=3, global_batch=16)
    assert [s.in_flight for s in evaluate(p, [1, 2], 1, opts).stages] == [3, 2, 1]


def test_memory_cap_is_inclusive():
    p = three_units()
    assert evaluate(p, [1], 2, CostOptions(pipeline_ranks=2, global_batch=8, memory_cap=5000)).feasible
    assert not evaluate(p, [1], 2, CostOptions(pipeline_ranks=2, global_batch=8, memory_cap=4999)).feasible


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
