"""What a solver returns: the plan it found, its cost, and its certificate (no solver imported here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from planner.cost.options import CostOptions
from planner.cost.result import PlanCost

OPTIMALITY_GAP = 1e-6  # a solution within this relative gap of the bound is reported as optimal


def scenario_gap(gap: float) -> float:
    """The relative gap each scenario's search proves for a whole search within `gap`: the global
    bound is the least of the scenarios' proven bounds (a scenario's cutoff is the best plan of any
    other), so half of OPTIMALITY_GAP keeps "optimal" clear of rounding, and a coarser request a
    thousandth below it."""
    return OPTIMALITY_GAP / 2 if gap <= OPTIMALITY_GAP else gap * (1 - 1e-3)


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
    requested_gap: float = OPTIMALITY_GAP  # the search stopped once its gap was at most this (`--gap`)


@dataclass
class Candidate:
    """A plan inside a solver's search: where the stages are cut (unit indices), which units are
    recomputed in backward, and its iteration time by the cost model (seconds)."""

    iteration_s: float
    boundaries: List[int]
    recompute: List[int] = field(default_factory=list)
