"""What a plan costs: StageCost per stage and PlanCost for the plan (planner.cost.model.evaluate)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class PathForm:
    """A path through a step's graph: how many times each duration term lies on it, and the tied
    weights' all-reduces through which it passes from one rank to another ((tie name, from, to)).
    Its value under any split's durations is a lower bound of that split's step time."""

    counts: Tuple[Tuple[Tuple, int], ...]
    crossings: Tuple[Tuple[str, int, int], ...] = ()

    def count(self) -> Dict[Tuple, int]:
        return dict(self.counts)


@dataclass
class StageCost:
    """One stage of an evaluated plan; times in seconds per micro-batch, memory in bytes."""

    first_unit: int
    end_unit: int  # exclusive
    device: int  # pipeline rank = stage index % p
    forward_s: float
    backward_s: float  # includes recomputed forwards (zero-bubble: its two parts' sum)
    comm_s: float  # its messages' transfer times (received and sent, both directions): for tables
    time_s: float  # forward + backward + comm_s: for tables
    in_flight: int  # the most micro-batches it holds for backward at once (its rank's list)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: float
    activation_bytes: int  # the most its micro-batches hold at once (in_flight x bytes each; zero-bubble: + weight parts)
    memory_bytes: float  # this stage's params + grads + optimizer + activations (its rank's: PlanCost)
    extra_s: float  # once per step on its rank: all-reduce + the collectives it takes part in
    recompute: List[int] = field(default_factory=list)  # unit indices recomputed in backward
    replicas: int = 1  # r_g: devices running this stage (device .. device + r_g - 1)
    # zero-bubble schedules: the backward's two parts (input gradients, weight gradients); None otherwise
    backward_input_s: Optional[float] = None
    backward_weight_s: Optional[float] = None
    # bytes one micro-batch holds from its forward to its backward (zero-bubble: to its input part), and
    # (zero-bubble) from its input part to its weight part
    saved_per_micro_batch: float = 0.0
    weight_held_per_micro_batch: Optional[float] = None


@dataclass
class PlanCost:
    micro_batch_size: int
    num_micro_batches: int  # m, per replica
    stages: List[StageCost]
    iteration_s: float  # the simulated step of the plan's lists + the step overhead
    bottleneck_s: float  # the busiest rank's forward and backward time per micro-batch
    bubble_fraction: float  # 1 - the ranks' forward and backward time / (ranks x step): their idle share
    feasible: bool  # every rank's memory fits its cap
    device_memory: List[float] = field(default_factory=list)  # M_i, one per device (replicas included)
    device_caps: List[Optional[float]] = field(default_factory=list)
    extra_s: float = 0.0  # the most a rank spends once per step after its list (all-reduce, optimizer step)
    schedule: str = "1f1b"
    pipeline_ranks: int = 1  # p (sum_g r_g with replicated stages)
    virtual_stages: int = 1
    data_parallel: int = 1
    critical_path: Optional[PathForm] = None  # the step's longest path
    durations: Dict[Tuple, float] = field(default_factory=dict)  # every duration term of the step graph
    collectives: Tuple = ()  # ((term, member ranks), ...) in the order every rank runs them
