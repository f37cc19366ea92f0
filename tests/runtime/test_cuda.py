"""The runtime on a CUDA device (skipped without one): NCCL beside gloo, device tensors end to end,
CUDA-event timing, the allocator's peak in the report. One GPU: single-rank plans, several stages
on the one rank (handed over in memory)."""
import dataclasses

import pytest
import torch

from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, report_of, reshape_plan

pytestmark = pytest.mark.cuda

# fp32 on a GPU: other kernels, other summation orders than the CPU reference
TOLERANCE = 1e-4


def _on_cuda(plan):
    return dataclasses.replace(plan, profile=dict(plan.profile, device="cuda"))


def _gpt(cuts, schedule="1f1b", b=2, g=8):
    return plan_with(profile_of("builtin:gpt", {"layers": 4}), cuts, b, g, schedule)


def test_one_stage_on_cuda_trains_like_one_cpu_process(tmp_path):
    plan = _on_cuda(_gpt([]))
    state = execute(plan, tmp_path, steps=3)
    losses = []
    assert max_abs_diff(state, reference_state(plan, losses=losses)) <= TOLERANCE
    report = report_of(tmp_path)
    assert [s["loss"] for s in report["steps"]] == pytest.approx(losses, rel=1e-4)
    (rank,) = report["stages"]
    assert rank["device"].startswith("cuda")
    assert rank["peak_memory_bytes"] >= rank["param_bytes"] > 0  # the allocator's peak
    assert rank["predicted_memory_bytes"] > 0
    measured = rank["measured"]
    assert 0 < measured["forward_s"] + measured["backward_s"] <= measured["step_s"] * 1.01  # CUDA events


@pytest.mark.parametrize("schedule", ["interleaved", "bfs"])
def test_stages_on_one_gpu_hand_over_in_memory(tmp_path, schedule):
    plan = _on_cuda(reshape_plan(_gpt([2]), virtual_stages=2, schedule=schedule))
    state = execute(plan, tmp_path, steps=2, extra=["--optimizer", "adamw"], lr=1e-3)
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1e-3, optimizer="adamw")) <= TOLERANCE


def test_step_clock_reads_cuda_events_once_per_step():
    from runtime.timing import StepClock

    clock = StepClock(torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")
    clock.start()
    for _ in range(3):
        clock.mark()
        a = a @ a / 2048
        clock.stop("matmul", "mm")
    totals, spans, step_s = clock.finish()
    assert len(spans) == 3 and 0 < totals["matmul"] <= step_s
    assert all(t1 >= t0 for _, t0, t1 in spans)
