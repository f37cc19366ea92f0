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


# every case under 1F1B; GPipe on the 2-stage ones (4 ranks on the 2-core CI machine cost 8-9 s a run,
# and GPipe's 4-stage lists differ from its 2-stage ones only in length)
RUNS = [(case, schedule) for case in CASES for schedule in ("gpipe", "1f1b") if schedule == "1f1b" or len(case[2]) == 1]


@pytest.mark.parametrize("entry,args,cuts,b,g,schedule", [(*case, schedule) for case, schedule in RUNS],
                         ids=[f"{c[0].split(':')[1]}-{len(c[2]) + 1}st" + ("-bn" if c[1] else "") + f"-{s}"
                              for c, s in RUNS])
def test_pipeline_matches_single_process(tmp_path, entry, args, cuts, b, g, schedule):
    profile = profile_of(entry, args)
    assert_trains_like_one_process(plan_with(profile, cuts, b, g, schedule), tmp_path, entry, args)
