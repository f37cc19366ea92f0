"""What a plan costs: StageCost per stage and PlanCost for the plan (planner.cost.model.evaluate)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class StageCost:
    """One stage of an evaluated plan; times in seconds per micro-batch, memory in bytes."""

    first_unit: int
    end_unit: int  # exclusive
    device: int  # pipeline rank = stage index % p
    forward_s: float
    backward_s: float  # includes recomputed forwards
    comm_s: float  # transfer time charged to this stage (receive + send, both directions)
    time_s: float  # T_c
    in_flight: int  # h_c
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: float
    activation_bytes: int  # h_c * A_c
    memory_bytes: float  # this stage's params + grads + optimizer + activations
    extra_s: float  # per-iteration: this stage's share of all-reduce + tied-parameter exchange
    recompute: List[int] = field(default_factory=list)  # unit indices recomputed in backward
    replicas: int = 1  # r_g: devices running this stage (device .. device + r_g - 1)


@dataclass
class PlanCost:
    micro_batch_size: int
    num_micro_batches: int  # m, per replica
    stages: List[StageCost]
    iteration_s: float
    bottleneck_s: float  # max_i D_i: the busiest rank's time per micro-batch (replicated: max_g n_g T_g / m)
    bubble_fraction: float  # 1 - m sum_c T_c / (p * pipeline time): idle share of the ranks
    feasible: bool  # every rank's memory fits its cap
    device_memory: List[float] = field(default_factory=list)  # M_i, one per device (replicas included)
    device_caps: List[Optional[float]] = field(default_factory=list)
    extra_s: float = 0.0  # max_i E_i
    schedule: str = "1f1b"
    pipeline_ranks: int = 1  # p (sum_g r_g with replicated stages)
    virtual_stages: int = 1
    data_parallel: int = 1
