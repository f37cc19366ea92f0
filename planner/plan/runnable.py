"""What `runtime execute` runs, as far as a plan alone decides it: the one rule the runtime refuses
plans by (runtime.options, runtime.shard_params) and `planner solve` notes on the plans it writes. Its
rules per precision and sharding are planner.cost.memory's (`--shard auto` chooses only among those
that run).

Plans beyond it are still planned: pure bf16 and parameter sharding under bf16-mixed are what large
models train with elsewhere, and their memory and time are planned as for this runtime's plans.
"""
from __future__ import annotations

from typing import Any, Optional

from planner.cost.memory import precision_refusal, shard_parameters_refusal


def plan_refusal(plan: Any) -> Optional[str]:
    """Why `runtime execute` does not run this plan whatever its options (one line), or None."""
    precision = getattr(plan, "precision", None) or "fp32"
    refused = precision_refusal(precision)
    if refused is None and plan.shard == "parameters":
        refused = shard_parameters_refusal(precision, plan.schedule, plan.topology().replicated)
    return refused
