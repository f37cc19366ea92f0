"""Subnormal floats: the profile records whether it flushed them, and every rank computes as it says
(planner.profile.subnormal)."""
import json

import pytest
import torch
from torch import nn

from planner.model.spec import ModelSpec
from planner.plan.file import load_plan
from planner.profile.measure import profile_model
from planner.profile.subnormal import flushed, flushing
from tests.capture_models.writes import to_random_targets
from tests.support.runs import execute, max_abs_diff, plan_with, report_of, reference_state, run_here

TINY = 2.0 ** -140  # subnormal in fp32: zero where subnormals are flushed


class SubnormalGate(nn.Module):
    """Passes x where |x| * 2^-140 is not flushed to zero: everything on a CPU computing on subnormal
    floats, nothing on one flushing them. What the layers before learn tells the two apart."""

    def forward(self, x):
        return x * ((x.detach().abs() * TINY) > 0).to(x.dtype)


def subnormal_gate(dim: int = 8) -> ModelSpec:
    module = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), SubnormalGate(), nn.Linear(dim, dim))
    return to_random_targets(module, dim, 1, 0)


ENTRY = "tests.runtime.test_subnormal:subnormal_gate"


def test_flushed_restores_what_held():
    before = flushing()
    with flushed(not before) as now:
        assert now == (not before) == flushing()
        with flushed(before):
            assert flushing() == before
        assert flushing() == (not before)
    assert flushing() == before


@pytest.mark.parametrize("flush", [True, False])
def test_the_profile_records_how_it_computed_and_leaves_the_process_as_it_was(flush):
    before = flushing()
    profile = profile_model(ENTRY, {}, [2], repeats=1, whole_model=False, flush_subnormals=flush)
    assert profile.flush_subnormals is flush
    assert profile.extra["measured_under"]["flush_subnormals"] is flush
    assert flushing() == before


def test_ranks_compute_as_the_profile_did(tmp_path):
    # the same split, profiled flushing (the default) and not: each run equals the single process
    # computing the same way, and the two differ (the gate is shut where subnormals are flushed)
    states = {}
    for flush in (True, False):
        plan = plan_with(profile_model(ENTRY, {}, [2], repeats=1, whole_model=False, flush_subnormals=flush),
                         [3], 2, 8, "1f1b")
        assert plan.flush_subnormals is flush
        out = tmp_path / str(flush)
        states[flush] = execute(plan, out, steps=2)
        assert {r["flush_subnormals"] for r in report_of(out)["stages"]} == {flush}
        assert max_abs_diff(states[flush], reference_state(plan, steps=2)) <= 1e-5
    assert max_abs_diff(states[True], states[False]) > 1e-3


def test_planner_profile_keeps_subnormals_on_request(tmp_path):
    out = tmp_path / "p.json"
    result = run_here(["planner.cli", "profile", ENTRY, "--micro-batch-sizes", "2", "--repeats", "1", "--warmup", "0",
                       "--min-time", "0", "--retries", "0", "--keep-subnormals", "-o", str(out), "--quiet"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.load(open(out))["measured_under"]["flush_subnormals"] is False
    solved = tmp_path / "plan.json"
    result = run_here(["planner.cli", "solve", str(out), "--stages", "2", "--global-batch", "4", "-o", str(solved)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "flush_subnormals" not in load_plan(str(solved)).profile  # the ranks compute on them, as measured
