"""What `planner solve` decides, `runtime execute` runs exactly: each joint decision end to end."""
import json

import pytest

from planner.plan.file import load_plan
from planner.profile.measure import profile_model
from planner.profile.profile import save_profile
from tests.support.runs import execute, max_abs_diff, reference_state, run_cli


@pytest.fixture(scope="module")
def gpt_profile(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prof") / "gpt.json")
    result = run_cli(["planner.cli", "profile", "builtin:gpt", "--model-arg", "layers=6", "--repeats", "3",
                      "--warmup", "0", "--min-time", "0", "--link", "none",
                      "--engine-cost", "none", "--quiet", "-o", path])
    assert result.returncode == 0, result.stderr
    return path


@pytest.mark.parametrize("solve_args,expect", [
    (["--devices", "4"], lambda p: p["data_parallel"] * p["pipeline_stages"] == 4),
    (["--stages", "2", "--schedule", "interleaved"], lambda p: p["virtual_stages"] == 2 and len(p["stages"]) == 4),
    (["--stages", "2", "--memory-per-device", "3MiB"], lambda p: any(s["recompute"] for s in p["stages"])),
], ids=["devices", "interleaved", "recompute"])
def test_solved_plan_runs_exactly(gpt_profile, tmp_path, solve_args, expect):
    plan_path = str(tmp_path / "solved.json")
    solved = run_cli(["planner.cli", "solve", gpt_profile, "--global-batch", "16", *solve_args, "-o", plan_path])
    assert solved.returncode == 0, solved.stderr
    assert expect(json.load(open(plan_path)))
    plan = load_plan(plan_path)
    state = execute(plan, tmp_path, steps=2, lr=0.05)  # `runtime execute`, in this process
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=0.05)) <= 1e-5


def test_solved_replicated_plan_runs_exactly(tmp_path):
    # a head that costs more than all blocks together and cannot be split: with 3 devices the
    # solver gives it 2 (micro-batches alternate between them), and the run stays exact. The cap
    # (the whole model's 16.8 MiB of weights and gradients do not fit) rules out plain data
    # parallelism, which the cost model can otherwise prefer on this small model
    profile, plan_path = str(tmp_path / "gpt.json"), str(tmp_path / "solved.json")
    measured = profile_model("builtin:gpt", {"layers": 2, "vocab": 16384}, [1, 2], repeats=3)
    # the premise made certain: measured, the head costs more than the rest on an idle host, but not
    # always under load (the solver then chose [2, 1], once in a full suite)
    head = next(u for u in measured.units if u.name == "head")
    for b in measured.micro_batch_sizes:
        rest = sum(u.forward_s[b] + u.backward_s[b] for u in measured.units if u is not head)
        share = rest / (head.forward_s[b] + head.backward_s[b])
        if share > 0.5:
            head.forward_s[b] *= 2 * share
            head.backward_s[b] *= 2 * share
            if head.split_backward:
                head.backward_input_s[b] *= 2 * share
                head.backward_weight_s[b] *= 2 * share
    save_profile(measured, profile)
    solved = run_cli(["planner.cli", "solve", profile, "--stages", "3", "--replicate", "--global-batch", "8",
                      "--memory-per-device", "14MiB", "-o", plan_path])
    assert solved.returncode == 0, solved.stderr
    plan = load_plan(plan_path)
    replicated = plan.stages[1].units
    assert [s.replicas for s in plan.stages] == [1, 2] and replicated[-1] == "head", replicated
    state = execute(plan, tmp_path, steps=2, lr=0.05)  # `runtime execute`, in this process
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=0.05)) <= 1e-5
