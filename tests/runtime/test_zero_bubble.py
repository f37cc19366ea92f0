"""Zero-bubble schedules train exactly like one process (max abs diff <= 1e-5, fp32): input
gradients first, weight gradients later (planner/profile/splitgrad.py), with a skip crossing stages, the V
placement, data parallelism (the last weight backward completes a gradient bucket), tied weights
and recomputation."""
import dataclasses

import pytest
import torch

from tests.support.runs import (assert_trains_like_one_process, execute, max_abs_diff, plan_with, profile_of,
                                reference_state, report_of)


def test_zb_h1_with_a_skip_across_stages(tmp_path):
    plan = plan_with(profile_of("tests.models:long_skip"), [1, 3, 5], 2, 8, "zb-h1")
    assert plan.stages[0].backward_input_s is not None and plan.stages[0].backward_weight_s is not None
    assert_trains_like_one_process(plan, tmp_path, "tests.models:long_skip")


def test_zb_v_runs_the_v(tmp_path):
    # 4 stages on 2 ranks: rank 0 runs the first and the last stage, rank 1 the two middle ones (handed
    # over in memory between stages 1 and 2)
    plan = plan_with(profile_of("builtin:gpt", {"layers": 6}), [2, 5, 7], 2, 8, "zb-v")
    assert [st.device for st in plan.stages] == [0, 1, 1, 0] and plan.virtual_stages == 2
    assert_trains_like_one_process(plan, tmp_path, "builtin:gpt", {"layers": 6})
    assert [s["chunks"] for s in report_of(tmp_path)["stages"]] == [[0, 3], [1, 2]]


def test_zb_h1_data_parallel_tied_weights_and_recomputation(tmp_path):
    # 2 x 2 ranks: the gradient buckets start after each rank's last weight backward; the tied
    # embedding/head weight is all-reduced across the pipeline; stage 1 recomputes its head
    plan = plan_with(profile_of("tests.models:tied_lm"), [2], 2, 4, "zb-h1")
    stages = [dataclasses.replace(plan.stages[0]), dataclasses.replace(plan.stages[1], recompute=["head"])]
    plan = dataclasses.replace(plan, stages=stages, data_parallel=2, global_batch=8)
    state = execute(plan, tmp_path)
    assert max_abs_diff(state, reference_state(plan)) <= 1e-5
    assert torch.equal(state["emb.weight"], state["head.weight"])


def test_show_json_names_the_split_backward():
    from planner.pipeline.schedule import build_schedule
    from runtime.program import actions_json

    kinds = {a["kind"] for rank in actions_json(build_schedule("zb-v", 4, 4, 2))["ranks"] for a in rank["actions"]}
    assert {"backward_input", "backward_weight"} <= kinds and "backward" not in kinds


def test_zb_h1_with_a_first_stage_nothing_trains_through(tmp_path):
    # frozen_tied_lm: the embedding and the first block are frozen, so no gradient reaches stage 0;
    # its input and weight parts have nothing to do (an IndexError before)
    plan = plan_with(profile_of("tests.models:frozen_tied_lm"), [2], 1, 4, "zb-h1")
    assert_trains_like_one_process(plan, tmp_path, "tests.models:frozen_tied_lm")


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_a_stage_sending_a_chunks_parts_made_from_its_parameters_trains_exactly(tmp_path, schedule):
    # the label embedding frozen, stage [1, 3) ends in a block's `mod` unit whose (shift, scale) parts of one
    # chunk, made from its parameters alone, go to the next stage: under ZB-H1 its weight part took both
    # parts' gradients as one's (5e-4 off one process; planner.profile.splitgrad's seeds by output)
    profile = profile_of("tests.capture_models:conditioned", {"frozen_labels": True}, sizes=(2,))
    assert [u.name for u in profile.units][1:4] == ["labels", "blocks.0.mod", "blocks.0.norm"]
    plan = plan_with(profile, [1, 3], 2, 4, schedule)
    assert max_abs_diff(execute(plan, tmp_path, steps=2), reference_state(plan, steps=2)) <= 1e-5
