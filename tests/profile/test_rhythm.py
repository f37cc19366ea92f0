"""The rhythm's latency: its formula is the step graph's for the same lists (a live measurement
records it beside the ping-pong's: tests/profile/test_measure.py, one run of both)."""
import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.profile.rhythm import MAX_COMPUTE_S, rhythm_latency, stand_in, summarise
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
