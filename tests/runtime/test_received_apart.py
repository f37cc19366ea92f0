"""Views of one storage that a stage receives apart (planner.cost.received), on a Glow-like flow
(tests.flow_models): the ranks hold what the plan says, to the byte.

The coupling's a = x[:, :3] and b = x[:, 3:] (b = 2, 6 features: 24 bytes each, one storage of 48) cross the
cuts before net_in, net_out and affine; net_in saves a, affine b. Inside a stage holding the mixing that makes x
they are one storage, saved by two units apart (a gap pair); a stage starting at net_in received them as two
and held both, where the plan took the pair's 48 bytes off and counted a alone (rank 1 held 176 bytes a
micro-batch on 152 planned under 1F1B; 96 more than planned under GPipe's four micro-batches); one starting at
net_out was planned b's whole storage (24 over)."""
import pytest

from tests.support.runs import execute, fixed_plan, profile_of, report_of

FLOW = "tests.flow_models:glow"


@pytest.mark.parametrize("args,schedule,cuts,recompute", [
    ({}, "1f1b", [7], []),  # a stage starting at the second coupling's net_in
    ({}, "gpipe", [8], []),  # ... at its net_out, which saves neither view
    ({}, "zb-h1", [7], []),
    ({}, "1f1b", [7], [8]),  # net_out recomputed keeps both views, which net_in and affine save one each
    ({"conditioner": "one"}, "1f1b", [6], []),  # the net one unit: neighbours saving one view each
    ({"input_gap": True}, "1f1b", [], []),  # the model input, saved by the first and last units: held once
    ({"input_gap": True}, "gpipe", [2, 7], []),
])
def test_views_a_stage_receives_apart_hold_what_the_plan_says(tmp_path, args, schedule, cuts, recompute):
    profile = profile_of(FLOW, args, sizes=(2,))
    execute(fixed_plan(profile, cuts, schedule, recompute), tmp_path, steps=1)
    for rank in report_of(tmp_path)["stages"]:
        assert rank["peak_saved_bytes"] == rank["predicted_activation_bytes"], rank


@pytest.mark.parametrize("schedule,recompute", [("1f1b", [7, 9]), ("zb-h1", [9])])
def test_recomputed_ends_over_views_received_apart_are_planned_no_lower_than_held(tmp_path, schedule, recompute):
    # a recomputed net_in keeps both views, which the affine two units on saves one of: no pair takes it off
    # (an over-count left, as for any recomputed end of a gap: planner.cost.shared_storage)
    execute(fixed_plan(profile_of(FLOW, sizes=(2,)), [7], schedule, recompute), tmp_path, steps=1)
    for rank in report_of(tmp_path)["stages"]:
        assert rank["peak_saved_bytes"] <= rank["predicted_activation_bytes"], rank
