"""The integer program of one scenario (schedule, p, d, v, micro-batch size b) over the exact model:
the split's variables (planner.solve.ilp_split), the tied weights' rows (planner.solve.ilp_ties), the
duration terms (planner.solve.ilp_durations) and the memory rows (planner.solve.ilp_memory).

The step time is the longest path of the lists' graph, the largest of its paths' sums; each known
path k (a critical-path form: counts c_k of duration terms) gives a row

    T >= sum_terms c_k(term) duration(term)                         minimise T + step_overhead

which holds for every split (the path exists whatever the durations). A path that crosses from
rank j to rank i through tied weight t's all-reduce exists only when both hold a use of t:
T >= form - M (2 - h[t][j] - h[t][i]).

With only some paths known, T is a lower bound of the step time of the split the program picks;
planner.solve.exact adds the picked split's own critical path until the two agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import pulp

from planner.cost.model import (boundary_links, num_micro_batches, rank_speeds, reduce_time, shared_parameters,
                                tie_time)
from planner.cost.options import CostOptions
from planner.cost.result import PathForm
from planner.cost.ranges import range_costs
from planner.pipeline.schedule import ZERO_BUBBLE_SCHEDULES
from planner.profile.profile import Profile
from planner.solve.backends import _run_cbc, _run_highs
from planner.solve.ilp_durations import DurationRows
from planner.solve.ilp_memory import MemoryRows
from planner.solve.ilp_split import MS, variable


@dataclass
class ProgramResult:
    boundaries: Optional[List[int]]
    recompute: List[int]
    value_s: Optional[float]  # T at the program's solution (a lower bound of that split's step)
    bound_s: float  # the solver's proven lower bound over every split (seconds), -inf if none
    optimal: bool  # the program was solved to optimality (or proven to have nothing below the cutoff)
    below_cutoff: bool  # a solution under the cutoff exists
    ran: bool = True  # False: the solver crashed (no answer at all)


class Program(DurationRows, MemoryRows):
    """The program for one scenario; rows for path forms are added before each solve."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, low: Sequence[int], high: Sequence[int],
                 deadline: Optional[float] = None):
        """OutOfTime past `deadline` (time.perf_counter(); checked per stage and device): at a thousand
        units the rows take seconds to build."""
        super().__init__(profile, b, opts, low, high)
        self.term: Dict[Tuple, object] = {("message",): opts.message_s * MS}  # every duration term's variable
        # whole_g of each later stage (`_whole_start`), read by its durations and by every memory row
        self.whole = {g: self._whole_start(g) for g in range(1, self.S)} \
            if opts.schedule in ZERO_BUBBLE_SCHEDULES else {}
        self._ties()
        self._durations(deadline)
        self._memory(deadline)
        self.T = variable(self.prob, "T")
        self.prob += self.T + opts.step_overhead_s * MS
        self.forms: List[PathForm] = []
        self.excluded = 0  # plans cut off (`exclude`)

    # --- paths ----------------------------------------------------------------------------------
    def add_form(self, form: PathForm, big_m_ms: float) -> None:
        counts = form.count()
        value = pulp.lpSum(n * self.term[t] for t, n in counts.items() if t in self.term)
        guard = 0
        for name, j, i in form.crossings:
            guard += (1 - self.hold.get((name, j), 0)) + (1 - self.hold.get((name, i), 0))
        n = len(self.forms)
        if form.crossings:
            self.add(self.T >= value - big_m_ms * guard, f"path_{n}")
        else:
            self.add(self.T >= value, f"path_{n}")
        self.forms.append(form)

    def exclude(self, boundaries: Sequence[int], recompute: Sequence[int]) -> None:
        """A row no split but this one (with this recomputation) satisfies: the program took it for a
        plan that fits where `evaluate` says it does not (a memory term it does not count), so it is cut
        off rather than proposed again:
        sum_g e[k_g][g] + sum_{l in R} rho[l][g_l] - sum_{l not in R} rho[l][g_l] <= S - 2 + |R|."""
        if any(not self.cut_may_end(k, g) for g, k in enumerate(boundaries)):
            return  # the program cannot pick it anyway
        edges = [0, *boundaries, self.L]
        stage = {l: g for g in range(self.S) for l in range(edges[g], edges[g + 1])}
        chosen = [r for (l, g), r in self.rho.items() if stage[l] == g and l in recompute]
        others = [r for (l, g), r in self.rho.items() if stage[l] == g and l not in recompute]
        self.add(pulp.lpSum(self.ends(k, g) for g, k in enumerate(boundaries)) + pulp.lpSum(chosen) - pulp.lpSum(others)
                 <= self.S - 2 + len(chosen), f"exclude_{self.excluded}")
        self.excluded += 1

    def warm_start(self, boundaries: Sequence[int], recompute: Sequence[int]) -> None:
        edges = list(boundaries) + [self.L]
        for l in range(self.L):
            for g in range(self.S):
                if isinstance(self.z[l][g], pulp.LpVariable):
                    self.z[l][g].setInitialValue(1 if l < edges[g] else 0)
        for (l, g), r in self.rho.items():
            r.setInitialValue(1 if l in recompute and (g == 0 or edges[g - 1] <= l) and l < edges[g] else 0)

    def solve(self, cutoff_s: Optional[float], time_limit: Optional[float], backend: str, gap: float = 1e-10
              ) -> ProgramResult:
        """Solve to a relative `gap`; cutoff_s: only splits whose T is below it are wanted (an incumbent's)."""
        if backend == "cbc":
            optimal, bound_ms, ran = _run_cbc(self.prob, time_limit, warm=False, gap=gap)
        else:
            constant = float(getattr(self.prob.objective, "constant", 0.0) or 0.0)
            cutoff = None if cutoff_s is None else cutoff_s * MS - constant
            optimal, bound_ms, ran = _run_highs(self.prob, time_limit, cutoff, gap=gap)
        if not ran:
            return ProgramResult(None, [], None, -math.inf, False, False, ran=False)
        constant = float(getattr(self.prob.objective, "constant", 0.0) or 0.0)
        bound = -math.inf if bound_ms is None else (bound_ms + constant) / MS
        if self.prob.sol_status == pulp.LpSolutionInfeasible or self.prob.status == pulp.LpStatusInfeasible:
            return ProgramResult(None, [], None, cutoff_s if cutoff_s is not None else math.inf, True, False)
        if self.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return ProgramResult(None, [], None, bound, optimal, False)
        value = lambda t: float(t) if isinstance(t, (int, float)) else float(pulp.value(t) or 0.0)
        boundaries = [sum(1 for l in range(self.L) if value(self.z[l][g]) > 0.5) for g in range(self.S - 1)]
        if self.opts.recompute == "all":
            chosen = list(range(self.L))
        else:
            chosen = sorted({l for (l, g), r in self.rho.items() if value(r) > 0.5 and value(self.x(l, g)) > 0.5})
        return ProgramResult(boundaries, chosen, value(self.T) / MS + self.opts.step_overhead_s, bound, optimal, True)


def big_m_ms(profile: Profile, b: int, opts: CostOptions, form: PathForm) -> float:
    """An upper bound (ms) of a form's value over all splits: every stage as slow as the whole model."""
    c = range_costs(profile, b, opts.optimizer)
    slowest = min(rank_speeds(opts))
    whole = (c.call_forward + c.call_backward + float(c.F[-1] + 2 * c.F[-1] + c.G[-1])) / slowest
    message = max(float(c.act.max(initial=0.0)), float(c.grad.max(initial=0.0)))
    links = boundary_links(opts) or [(opts.bandwidth, opts.latency)]
    per_message = max(lat + message / bw for bw, lat in links) + opts.message_s
    ties = sum(tie_time(size, opts.pipeline_ranks * opts.tie_replicas, opts)
               for _, _, size in shared_parameters(profile))
    reduce = max(reduce_time(float(c.P[-1]), float(c.T[-1]), float(c.FB[-1]), opts, profile.dtype,
                             num_micro_batches(opts, b), i, float(c.COLL[-1]), float(c.BUF[-1]))
                 for i in range(opts.pipeline_ranks)) + \
        float(c.O[-1]) / slowest
    return (sum(form.count().values()) * (whole + per_message) + ties + reduce) * MS * 2 + 1.0
