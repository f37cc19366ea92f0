"""What a solver returns: the plan it found, its cost, and its certificate (no solver imported here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from planner.cost.options import CostOptions
from planner.cost.result import PlanCost

OPTIMALITY_GAP = 1e-6  # a solution within this relative gap of the bound is reported as optimal


@dataclass
class Solution:
    boundaries: List[int]
    micro_batch_size: int
    num_micro_batches: int
    cost: PlanCost
    status: str  # "optimal" | "feasible" (stopped early; gap reported)
    objective: float  # iteration time in seconds of this plan, per the cost model
    bound: float  # proven lower bound on the optimal iteration time, seconds
    gap: float  # (objective - bound) / objective
    seconds: float  # wall time of the solve
    method: str  # "ilp" | "dp" | "brute" | "uniform" | "params" | "block"
    backend: str  # "cbc" | "highs" | "python"
    recompute: List[int] = field(default_factory=list)  # unit indices recomputed in backward
    options: Optional[CostOptions] = None  # the concrete scenario (p, d, v, schedule) chosen


@dataclass
class Split:
    """A plan inside a solver's search: where the stages are cut (unit indices), which units are
    recomputed in backward, and its iteration time by the cost model (seconds)."""

    iteration_s: float
    boundaries: List[int]
    recompute: List[int] = field(default_factory=list)
