"""The partitioners other tools ship, judged by this project's cost model (`--method uniform|params|block`).

- uniform (DeepSpeed `partition_method="uniform"`): C = p v stages of floor(L / C) units, the first
  L mod C stages one unit more.
- params (DeepSpeed `"parameters"`): split minimising the largest stage's parameter bytes
  (min over splits of max_c sum_{l in c} P_l, exact by the min-max DP; DeepSpeed's
  `partition_balanced` solves the same problem by bisection).
- block (torchgpipe `balance_by_time`): split minimising the largest stage's compute time
  sum f_l + g_l at the chosen b, ignoring transfers and memory. torchgpipe's block-partition
  heuristic approximates this min-max; the exact DP is used here, so the baseline is at least as
  good as torchgpipe's own answer on its own objective.

None of these tools chooses the micro-batch size or recomputation: the user gives m (or b). To be
generous to them, every candidate b is tried with the split and the best *feasible* one by the cost
model is reported (recomputation as --recompute none/all says; 'auto' counts as none). If no b
fits, the fastest infeasible plan is returned with cost.feasible False and status "infeasible".
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from planner.cost.model import candidate_micro_batch_sizes, evaluate
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.solve.diagnose import min_max_partition
from planner.solve.solution import Solution

BASELINES = ("uniform", "params", "block")


def uniform_split(num_units: int, num_stages: int) -> List[int]:
    """Boundaries of DeepSpeed's uniform partition."""
    size, extra = divmod(num_units, num_stages)
    edges, at = [], 0
    for c in range(num_stages - 1):
        at += size + (1 if c < extra else 0)
        edges.append(at)
    return edges


def balanced_split(weights: List[float], num_stages: int) -> List[int]:
    """Boundaries minimising the largest stage's sum of weights (exact min-max DP)."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])
    n = prefix.shape[0]
    table = np.where(np.triu(np.ones((n, n), dtype=bool), 1), prefix[None, :] - prefix[:, None], np.inf)
    return min_max_partition(len(weights), num_stages, lambda c: table)[1]


def baseline_split(profile: Profile, method: str, b: int, num_stages: int) -> List[int]:
    if method == "uniform":
        return uniform_split(profile.num_units, num_stages)
    if method == "params":
        return balanced_split([float(u.param_bytes) for u in profile.units], num_stages)
    if method == "block":
        return balanced_split([u.forward_s[b] + u.backward_s[b] for u in profile.units], num_stages)
    raise ValueError(f"unknown baseline {method!r}; use one of {', '.join(BASELINES)}")


def solve_baseline(profile: Profile, scenarios: List[CostOptions], method: str) -> Optional[Solution]:
    """The baseline's plan over the scenarios: best feasible (scenario, b), else the fastest infeasible."""
    started = time.perf_counter()
    best = None  # (feasible, iteration, boundaries, b, opts, cost, recompute)
    for opts in scenarios:
        redo = list(range(profile.num_units)) if opts.recompute == "all" else []
        for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
            boundaries = baseline_split(profile, method, b, opts.num_stages)
            cost = evaluate(profile, boundaries, b, opts, redo)
            key = (not cost.feasible, cost.iteration_s)
            if best is None or key < (not best[0], best[1]):
                best = (cost.feasible, cost.iteration_s, boundaries, b, opts, cost, redo)
    if best is None:
        return None
    feasible, iteration, boundaries, b, opts, cost, redo = best
    return Solution(boundaries=list(boundaries), micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                    cost=cost, status="heuristic" if feasible else "infeasible", objective=iteration,
                    bound=float("nan"), gap=float("nan"), seconds=time.perf_counter() - started, method=method,
                    backend="python", recompute=redo, options=opts)
