"""A cluster's slow link emulated on one machine (runtime/emulation.py, issue 22): the plan names the
boundaries that cross it, the runtime holds each message crossing it for its planned transfer, and
the run is predicted within 15 % while it trains exactly like one process."""
import pytest

from planner.cost.cluster import cluster_from_json
from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.pipeline.actions import Action, ActionKind
from planner.plan.make import make_plan
from planner.solve.solution import Solution
from runtime.emulation import crossing, link_delays
from tests.support.runs import execute, max_abs_diff, profile_of, reference_state, report_of

SLOW = {"groups": [{"devices": 1}, {"devices": 1}], "links": [{"bandwidth": "100MB", "latency": 0.1, "emulate": True}]}


def _plan(cluster_json, boundaries=(2,), b=2, g=8):
    profile = profile_of("builtin:mlp", {"layers": 4}, sizes=(b,))
    opts = CostOptions(pipeline_ranks=2, global_batch=g, cluster=cluster_from_json(cluster_json))
    cost = evaluate(profile, list(boundaries), b, opts)
    solution = Solution(boundaries=list(boundaries), micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                        cost=cost, status="fixed", objective=cost.iteration_s, bound=cost.iteration_s, gap=0.0,
                        seconds=0.0, method="fixed", backend="none", options=opts)
    return make_plan(profile, solution, opts, "test")


def test_the_plan_names_the_boundaries_crossing_an_emulated_link():
    assert _plan(SLOW).emulated_boundaries == [0]
    plain = dict(SLOW, links=[dict(SLOW["links"][0], emulate=False)])
    assert _plan(plain).emulated_boundaries == []
    with pytest.raises(ValueError, match="emulate"):
        cluster_from_json(dict(SLOW, links=[dict(SLOW["links"][0], emulate="yes")]))
    delays = link_delays(_plan(SLOW))
    assert set(delays) == {("act", 0), ("grad", 0)} and delays[("act", 0)] >= 0.1
    # a message's boundary: stage g sends activations over g and gradients over g - 1
    assert crossing(Action(ActionKind.SEND_ACT, 0, 0)) == ("act", 0)
    assert crossing(Action(ActionKind.RECV_ACT, 0, 1)) == ("act", 0)
    assert crossing(Action(ActionKind.SEND_GRAD, 0, 1)) == ("grad", 0)
    assert crossing(Action(ActionKind.RECV_GRAD, 0, 0)) == ("grad", 0)


def test_a_run_over_an_emulated_slow_link_is_predicted(tmp_path):
    plan = _plan(SLOW)
    state = execute(plan, tmp_path, steps=3)
    report = report_of(tmp_path)
    predicted = report["predicted_iteration_s"]
    # 100 ms per message dominate: 1F1B with m = 4 crosses the link on its critical path six times.
    # The fastest step: a loaded host only ever adds time (a sleeping rank woken late)
    measured = min(step["time_s"] for step in report["steps"])
    assert predicted > 0.5
    assert abs(measured - predicted) / predicted < 0.15, (measured, predicted)
    assert max_abs_diff(state, reference_state(plan, steps=3)) <= 1e-5
