"""The pipeline trains exactly like one process: saved state after 3 steps vs single-process
training on the same micro-batches, max abs diff <= 1e-5 (fp32)."""
import pytest

from tests.support.runs import assert_trains_like_one_process, plan_with, profile_of

CASES = [
    # (entry, model args, cuts, micro-batch size, global batch)
    ("builtin:gpt", {}, [4], 2, 8),             # 2 stages
    ("builtin:gpt", {}, [1, 3, 6], 1, 8),       # 4 stages; cut 1 is crossed by an int tensor and a float one
    ("builtin:resnet", {}, [3], 2, 8),          # 2 stages, residual blocks
    ("builtin:resnet", {"batchnorm": True}, [2], 2, 8),  # buffers (running statistics) stay consistent
    ("tests.models:long_skip", {}, [1, 3, 5], 2, 8),     # a skip across three cuts, a constant crossing
]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("entry,args,cuts,b,g", CASES, ids=[f"{c[0].split(':')[1]}-{len(c[2]) + 1}st" + ("-bn" if c[1] else "") for c in CASES])
def test_pipeline_matches_single_process(tmp_path, entry, args, cuts, b, g, schedule):
    profile = profile_of(entry, args)
    assert_trains_like_one_process(plan_with(profile, cuts, b, g, schedule), tmp_path, entry, args)
