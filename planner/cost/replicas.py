"""Replicated stages in the cost model: what one replica device holds, and the plan's cost.

The maths is planner.cost.model's module docstring ("Replicated stages"); planner.cost.model.evaluate
builds the stages and calls replicated_plan_cost when some r_g > 1.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from planner.cost.options import CostOptions
from planner.cost.result import PlanCost, StageCost
from planner.pipeline.schedule import one_f_one_b_warmups


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def replica_in_flight(stage: int, replicas: Sequence[int], m: int, schedule: str) -> int:
    """h_g per replica device: gpipe ceil(m / r_g); 1f1b ceil(min(w_g + 1, m) / r_g) with the warm-up
    w_g of the unreplicated order each replica filters (planner.pipeline.schedule.one_f_one_b_warmups, the
    runtime's own rule: w_last = r_last - 1, w_g = w_{g+1} + max(r_g, r_{g+1}))."""
    r = replicas[stage]
    if schedule == "gpipe":
        return ceil_div(m, r)
    warmup = one_f_one_b_warmups(replicas, m)[stage]
    return ceil_div(min(warmup + 1, m), r)


def replicated_plan_cost(stages: List[StageCost], b: int, m: int, opts: CostOptions, cap: Optional[float]) -> PlanCost:
    """The PlanCost of replicated stages: iteration = sum T + max (n_g - 1) T_g + max E + overhead."""
    n = [ceil_div(m, st.replicas) for st in stages]
    devices = [st for st in stages for _ in range(st.replicas)]  # device k runs stage devices[k]
    total = sum(st.time_s for st in stages)
    pipeline = total + max((n_g - 1) * st.time_s for n_g, st in zip(n, stages))
    extra = max(st.extra_s for st in stages)
    memory = [st.memory_bytes for st in devices]
    bubble = 1.0 - m * total / (len(devices) * pipeline) if pipeline > 0 else 0.0
    return PlanCost(micro_batch_size=b, num_micro_batches=m, stages=stages,
                    iteration_s=pipeline + extra + opts.per_step_s,
                    bottleneck_s=max(n_g * st.time_s for n_g, st in zip(n, stages)) / m,
                    bubble_fraction=max(0.0, bubble), feasible=all(cap is None or x <= cap for x in memory),
                    device_memory=memory, device_caps=[cap] * len(devices), extra_s=extra,
                    schedule=opts.schedule, pipeline_ranks=len(devices), virtual_stages=1,
                    data_parallel=opts.data_parallel)
