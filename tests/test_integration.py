"""What `planner solve` decides, `runtime execute` runs exactly: each joint decision end to end."""
import json

import pytest
import torch

from tests.pipeline import max_abs_diff, reference_state, run_cli


@pytest.fixture(scope="module")
def gpt_profile(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prof") / "gpt.json")
    result = run_cli(["planner.cli", "profile", "builtin:gpt", "--model-arg", "layers=6", "--repeats", "3",
                      "--quiet", "-o", path])
    assert result.returncode == 0, result.stderr
    return path


@pytest.mark.parametrize("solve_args,expect", [
    (["--devices", "4"], lambda p: p["data_parallel"] * p["pipeline_stages"] == 4),
    (["--stages", "2", "--schedule", "interleaved"], lambda p: p["virtual_stages"] == 2 and len(p["stages"]) == 4),
    (["--stages", "2", "--memory-per-device", "3MiB"], lambda p: any(s["recompute"] for s in p["stages"])),
], ids=["devices", "interleaved", "recompute"])
def test_solved_plan_runs_exactly(gpt_profile, tmp_path, solve_args, expect):
    plan_path, state_path = str(tmp_path / "plan.json"), str(tmp_path / "state.pt")
    solved = run_cli(["planner.cli", "solve", gpt_profile, "--global-batch", "16", *solve_args, "-o", plan_path])
    assert solved.returncode == 0, solved.stderr
    plan = json.load(open(plan_path))
    assert expect(plan), plan
    ran = run_cli(["runtime.cli", "execute", plan_path, "--steps", "2", "--lr", "0.05", "--save-state", state_path])
    assert ran.returncode == 0, ran.stderr
    state = torch.load(state_path, weights_only=True)
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=0.05)) <= 1e-5
