"""What `runtime execute` runs, as far as a plan alone decides it: the one rule the runtime refuses
plans by (runtime.options, runtime.shard_params) and `planner solve` notes on the plans it writes.

Plans beyond it are still planned: pure bf16 and parameter sharding under bf16-mixed are what large
models train with elsewhere, and their memory and time are planned as for this runtime's plans.
"""
from __future__ import annotations

from typing import Any, Optional

from planner.pipeline.zerobubble import ZERO_BUBBLE_SCHEDULES

RUN_PRECISIONS = ("fp32", "bf16-mixed")  # planner.cost.memory's words; pure bf16 is planned, not run


def precision_refusal(precision: str) -> Optional[str]:
    """Why a plan for `precision` does not run (one line: cause and fix), or None."""
    if precision in RUN_PRECISIONS:
        return None
    return (f"the plan is for precision {precision}, which this runtime does not run (it runs "
            f"{' and '.join(RUN_PRECISIONS)}); re-plan with `planner solve --precision bf16-mixed`")


def shard_parameters_refusal(precision: str, schedule: str, replicated: bool) -> Optional[str]:
    """Why parameters sharded across data-parallel holders (ZeRO-3) do not run with this precision,
    schedule and stage replicas (one line: cause and fix), or None."""
    fix = "; re-plan with `planner solve --shard gradients`"
    if replicated:  # a stage's lanes run different micro-batches: their gathers would not pair up
        return ("a plan sharding parameters across replicated stages (--replicate) is not supported; re-plan "
                "without --replicate or with `planner solve --shard optimizer`")
    if precision != "fp32":
        return f"precision {precision} with a plan sharding parameters is not supported (plan it in fp32{fix})"
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return f"the zero-bubble schedule {schedule} with a plan sharding parameters is not supported{fix}"
    return None


def plan_refusal(plan: Any) -> Optional[str]:
    """Why `runtime execute` does not run this plan whatever its options (one line), or None."""
    precision = getattr(plan, "precision", None) or "fp32"
    refused = precision_refusal(precision)
    if refused is None and plan.shard == "parameters":
        refused = shard_parameters_refusal(precision, plan.schedule, plan.topology().replicated)
    return refused
