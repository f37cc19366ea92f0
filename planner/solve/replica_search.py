"""The closed form of replicated stages' step and its exact search (`ReplicaSearch`), for
planner.solve.replicas (which simulates and polishes what it finds).

The problem. N devices per data-parallel replica; choose S <= N stages (contiguous unit ranges
[a_g, e_g)), replica counts r_g >= 1 with sum_g r_g = N and r_g <= m, and the micro-batch size b,
minimising

    F = sum_g T_g + max_g X_g + max_g E_g (+ step overhead, a constant)
    T_g = T(a_g, e_g)                        (compute + transfers; no cluster, so no position term
                                              beyond "has a predecessor / a successor")
    X_g = (ceil(m / r_g) - 1) T_g            E_g = the exchange of P(a_g, e_g) over n = r_g d holders

subject to M_g = P_g beta_g + h_g A_g + ceil(m / r_g) (in_{a_g} + grad_{e_g}) <= cap (beta_g: static
bytes per parameter byte over n = r_g d holders; the last term bounds the received activations and
gradients a device holds before using them), k_g = sum_{h>=g} r_h the devices from stage g to the
end; gpipe: h_g = ceil(m / r_g); 1f1b: h_g = ceil(min(w_g + 1, m) / r_g) with the runtime's warm-up
w_g = w_{g+1} + max(r_g, r_{g+1}), which depends on the whole suffix. The DP knows (r_g, k_g) only, so
under a cap it runs with the largest w over all suffixes of (r_g, k_g) (planner.solve.replica_tables'
`suffix_warmups`: every plan found fits) and again with the smallest (a lower bound, whose plan is
taken when it fits the exact model: time does not depend on the held counts, so it is then optimal);
the gap is 0 when the two meet, as they do without a cap or when the cap does not bind.

Suffix DP. Every per-stage quantity depends only on (a, e, r, k), so for thresholds (tau, eps)

    g(tau, eps) = min sum_g T_g  subject to  X_g <= tau, E_g <= eps, M_g <= cap
    best_0(L) = 0;  best_k(a) = min_{e > a, 1 <= r <= min(k, m)} T(a, e) [allowed] + best_{k-r}(e)

is exact (state: first unit a of the suffix, devices k it uses; answer best_N(0)); O(N^2 L^2) per DP.

Thresholds (the proof). OPT = min over (tau, eps) in the candidate values (the values X and E
take) of g(tau, eps) + tau + eps: the optimal plan is feasible at its own maxima, and any plan
found at (tau, eps) has maxima <= (tau, eps), so its true F is no larger than the bound. g is
non-increasing in both arguments. Inner search, eps fixed, over tau: when the plan found at tau
has max X = x, g is constant on [x, tau] (that plan is feasible at x), so one DP settles every
threshold there; an interval of thresholds [tau_lo, tau_hi] whose right end is known to have
g >= g_r costs at least g_r + tau_lo + eps, and is discarded when that reaches the incumbent.
This branch and bound returns F(eps) = min_tau g(tau, eps) + tau exactly, or a lower bound on it
(the least bound among discarded intervals) when nothing at eps beats the incumbent. Outer search
over eps: F(eps) is non-increasing, so the same branch and bound on F(eps) + eps with those
lower bounds is exact. Every discarded set is bounded below by the incumbent (up to the relative
tolerance TOL), so the plan returned is optimal: the solver reports gap 0 only after the search
is complete. The micro-batch sizes are enumerated, each seeded with the best plan so far.
"""
from __future__ import annotations

import heapq
import math
from typing import Optional, Tuple

import numpy as np

from planner.solve.chain import TOL
from planner.solve.floors import OutOfTime, check_deadline
from planner.solve.replica_tables import ReplicaSplit, ReplicaTables


class ReplicaSearch:
    """The branch and bound of the module docstring at one micro-batch size; incumbent U excludes the overhead.

    `run` stops at the tables' deadline (each DP reads the clock): `best` is then the best plan found,
    and `stopped` says the search is not complete (its plan is not the closed form's optimum)."""

    def __init__(self, tables: ReplicaTables, incumbent: float) -> None:
        self.t, self.U, self.best = tables, incumbent, None
        self.stopped = False

    def run(self, deadline: Optional[float] = None) -> None:
        """The first plans (the least sum, the least max X, the least max E: three DPs) by the tables'
        deadline, then the branch and bound by `deadline` too (the earlier of the two); past either,
        `stopped` and the best plan found so far."""
        try:
            self._first_plans()
            if deadline is not None:
                self.t.deadline = deadline if self.t.deadline is None else min(deadline, self.t.deadline)
            self._thresholds()
        except OutOfTime:
            self.stopped = True

    def _first_plans(self) -> None:
        tables = self.t
        self.g_top, top = tables.min_sum()
        self.tau_star, by_x = tables.min_max(tables.X)
        self.eps_star, by_e = tables.min_max(tables.Ek)
        for plan in (top, by_x, by_e):
            if plan is not None:
                self.consider(plan)
        check_deadline(tables.deadline)  # (the candidates: a sort of up to (r, k) pairs x L^2 / 2 values)
        self.x_values = tables.candidates(tables.X)
        self.e_values = tables.candidates(tables.Ek)
        self.x_values = self.x_values[self.x_values >= self.tau_star]
        self.e_values = self.e_values[self.e_values >= self.eps_star]

    def consider(self, plan: ReplicaSplit) -> Tuple[float, float, float]:
        s, x, e = self.t.values(plan)
        if s + x + e < self.U:
            self.U, self.best = s + x + e, plan
        return s, x, e

    def inner(self, eps: float) -> Tuple[float, float, Optional[float]]:
        """(lower bound on F(eps), best sum + max X found with max E <= eps, that plan's max E)."""
        values = self.x_values
        found: Tuple[float, Optional[float]] = (math.inf, None)
        lower = math.inf
        heap = [(-math.inf, 0, len(values) - 1, math.inf)]
        while heap:
            _, lo, hi, g_right = heapq.heappop(heap)
            floor = g_right if math.isfinite(g_right) else self.g_top
            cut = min(hi, int(np.searchsorted(values, self.U * (1 + TOL) - eps - floor, side="right")) - 1)
            if cut < hi:
                lower = min(lower, floor + values[max(cut + 1, lo)])
            hi = cut
            if lo > hi:
                continue
            if math.isfinite(g_right) and g_right + values[lo] + eps >= self.U * (1 - TOL):
                lower = min(lower, g_right + values[lo])
                continue
            mid = hi if not math.isfinite(g_right) else (lo + hi) // 2
            g, plan = self.t.min_sum(float(values[mid]), eps)
            if plan is None:  # nothing at or below values[mid]
                if mid + 1 <= hi:
                    heapq.heappush(heap, (g_right + values[mid + 1], mid + 1, hi, g_right))
                continue
            s, x, e = self.consider(plan)
            if s + x < found[0]:
                found = (s + x, e)
            k = int(np.searchsorted(values, x, side="left"))  # g is constant on [x, values[mid]]
            if k > lo:
                heapq.heappush(heap, (g + values[lo], lo, k - 1, g))
            if mid + 1 <= hi:
                heapq.heappush(heap, (g_right + values[mid + 1], mid + 1, hi, g_right))
        return min(lower, found[0]), found[0], found[1]

    def _thresholds(self) -> None:
        values = self.e_values
        if not math.isfinite(self.g_top) or values.size == 0:
            return
        base = self.g_top + self.tau_star  # F(eps) >= base for every eps
        heap = [(base + values[0], 0, len(values) - 1, base, True)]
        while heap:
            _, lo, hi, f_right, first = heapq.heappop(heap)
            hi = min(hi, int(np.searchsorted(values, self.U * (1 + TOL) - f_right, side="right")) - 1)
            if lo > hi or f_right + values[lo] >= self.U * (1 - TOL):
                continue
            mid = hi if first else (lo + hi) // 2
            f_low, f, e_act = self.inner(float(values[mid]))
            f_low = max(f_low, f_right)
            right = mid - 1
            if e_act is not None and f_low >= f:  # F exact at mid and constant on [e_act, values[mid]]
                right = int(np.searchsorted(values, e_act, side="left")) - 1
            if right >= lo:
                heapq.heappush(heap, (f_low + values[lo], lo, right, f_low, False))
            if mid + 1 <= hi:
                heapq.heappush(heap, (f_right + values[mid + 1], mid + 1, hi, f_right, False))
