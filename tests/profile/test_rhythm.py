"""The rhythm's latency: its formula is the step graph's for the same lists (a live measurement
records it beside the ping-pong's: tests/profile/test_measure.py, one run of both)."""
import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.profile.rhythm import MAX_COMPUTE_S, rhythm_latency, rhythm_message_cost, stand_in, summarise
from tests.support.synthetic import synthetic_profile


@pytest.mark.parametrize("forward,backward,m,latency", [
    (1e-3, 2e-3, 8, 5e-4), (2e-3, 1e-3, 8, 1e-3), (3e-3, 3e-3, 4, 2e-4), (1e-3, 1e-3, 4, 0.0), (2e-3, 2e-3, 16, 4e-3)])
def test_the_formula_is_the_step_graph_of_a_two_stage_1f1b(forward, backward, m, latency):
    """(m + 1)(F + B) + (m + 2) lam is what planner.cost's simulation of the runtime's 1F1B lists
    gives for two equal stages with free transfers, so the lam fitted from a step is the latency a
    plan then charges."""
    profile = synthetic_profile(forward=[forward, forward], backward=[backward, backward], params=[0, 0],
                                saved=[0, 0], cut_act=[4], sizes=(1,))
    opts = CostOptions(pipeline_ranks=2, global_batch=m, schedule="1f1b", bandwidth=1e30,
                       latency=latency)
    step = evaluate(profile, [1], 1, opts).iteration_s
    assert step == pytest.approx((m + 1) * (forward + backward) + (m + 2) * latency, rel=1e-9)
    assert rhythm_latency(step, forward, backward, m) == pytest.approx(latency, abs=1e-12)


def test_the_latency_is_never_negative_and_needs_two_micro_batches():
    assert rhythm_latency(0.001, 1e-3, 1e-3, 8) == 0.0  # a step faster than its compute: noise
    with pytest.raises(ValueError, match="four micro-batches"):
        rhythm_latency(0.01, 1e-3, 1e-3, 3)
    # compute longer than MAX_COMPUTE_S is timed at it (planner.profile.link.measure_link caps it once),
    # and the record says what was timed
    assert stand_in(1.0, 1e-3) == (MAX_COMPUTE_S, 1e-3)
    record = summarise([1.0, 1.0, 1.0], MAX_COMPUTE_S, 1e-3)
    assert record["forward_s"] == MAX_COMPUTE_S and record["backward_s"] == 1e-3 and record["steps"] == 3


@pytest.mark.parametrize("forward,backward,m,latency,message", [
    (1e-3, 2e-3, 8, 1e-5, 4e-5), (2e-3, 1e-3, 8, 2e-5, 1e-4), (3e-3, 3e-3, 4, 0.0, 5e-6), (5e-4, 1e-3, 16, 1e-5, 3e-4),
    (1e-3, 1e-3, 4, 1e-5, 0.0)])
def test_the_message_cost_is_what_the_plan_charges_for_the_measured_step(forward, backward, m, latency, message):
    """rhythm_message_cost inverts planner.cost's evaluation of the same lists: a step evaluated with
    a per-operation cost gives that cost back, so the plan charges what the engine's lists paid."""
    profile = synthetic_profile(forward=[forward, forward], backward=[backward, backward], params=[0, 0],
                                saved=[0, 0], cut_act=[4], sizes=(1,))
    opts = CostOptions(pipeline_ranks=2, global_batch=m, schedule="1f1b", bandwidth=1e30, latency=latency,
                       message_s=message)
    step = evaluate(profile, [1], 1, opts).iteration_s
    assert rhythm_message_cost(step, forward, backward, latency, m) == pytest.approx(message, rel=1e-6, abs=1e-12)
    # a step no longer than the lists at no cost (noise) reads as no cost; fewer than four micro-batches no reading
    assert rhythm_message_cost((m + 1) * (forward + backward), forward, backward, latency, m) == 0.0
    with pytest.raises(ValueError, match="four micro-batches"):
        rhythm_message_cost(step, forward, backward, latency, 3)
