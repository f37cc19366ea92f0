"""Fast exact solver for one v = 1 scenario on a chain (no tied parameters, fixed recomputation).

For a micro-batch size b, stage c (on rank c, speed sigma_c) holding units [a, e) costs

    T_c(a, e) = (W_e - W_a) / sigma_c + tin_c(a) + tout_c(e)       (W: prefix sums of f + g,
    E_c(a, e) = ar (P_e - P_a)                                       plus f under 'all'; tin_c
                                                                     holds the stage's own cost k / sigma_c)
    M_c(a, e) = (P_e - P_a) beta + h_c (A_e - A_a) <= cap_c      (else the entry is +inf)

and the objective of a split is  F = sum_c T_c + (m - 1) max_c T_c + max_c E_c (plus the
constant step overhead, added to the result).

Thresholds. With g(tau, eps) = min { sum_c T_c : T_c <= tau, E_c <= eps } (a min-sum DP),
OPT = min_{tau, eps} g(tau, eps) + (m - 1) tau + eps, and g is non-increasing in both. If the
minimising split at (tau, eps) has max T = t' <= tau, g is constant on [t', tau] (the same split
is feasible there and g cannot increase), so one DP settles the whole interval; on any interval
[tau_lo, tau_hi] whose right end has known value g_r, every point costs at least
g_r + (m - 1) tau_lo + eps. Branch and bound over the sorted candidate thresholds (the values
T takes) with these two facts is exact, and usually needs a few dozen DPs. The same argument
applied to eps (F_eps(eps) = min over splits with max E <= eps of sum + (m - 1) max T, also
non-increasing) gives the outer branch and bound when d > 1 (for d = 1, E = 0).

Band. Every split better than an incumbent U has max T <= tau_hi = (U - g_lb - eps_lb) / (m - 1)
(g_lb: the unconstrained min sum, by a prefix minimum since T_c is separable in a and e), and
T_c(a, e) >= (W_e - W_a) / sigma_max, so only starts a >= lo(e) = min{a : W_e - W_a <= tau_hi
sigma_max} matter. The DPs run on a band of K = max_e (e - lo(e)) starts per end: O(C L K)
numpy work per DP instead of O(C L^2), and O(L K) memory per distinct stage table.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from planner.cost.model import (boundary_links, cut_times, held_counts, num_micro_batches, rank_caps,
                                rank_speeds, stage_call_s, static_factors, sync_factors)
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.profile.profile import Profile
from planner.solve.floors import OutOfTime, check_deadline

TOL = 1e-12  # relative tolerance of every prune (objectives are O(1) s; far below the reported gap)


@dataclass
class ChainResult:
    """The optimum of one scenario (exact within TOL; the best found when a deadline cut the search
    short): objective (s), boundaries, and DP counts."""

    objective: float
    boundaries: List[int]
    min_max: float  # tau*: the least possible max_c T_c (a lower bound on the bottleneck; nan unless exact)
    min_sum: float  # g_lb: the least possible sum_c T_c
    evaluations: int
    exact: bool = True  # False: stopped at the deadline


class ChainScenario:
    """Prefix sums and banded stage tables for (profile, b, opts); `caps=False` drops memory caps."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, caps: bool = True,
                 added: Optional[List[np.ndarray]] = None) -> None:
        costs = range_costs(profile, b)
        self.added = added  # per stage, [a, e]: extra time >= 0 (recomputation), +inf where nothing fits
        self.L, self.C = profile.num_units, opts.num_stages
        self.m = num_micro_batches(opts, b)
        redo_all = opts.recompute == "all"
        self.W = costs.work_prefix(redo_all)
        self.monotone = bool(np.all(np.diff(self.W) >= 0))
        self.P, self.T = costs.P, costs.T  # parameter bytes and, of them, the trainable ones
        self.FB = costs.FB  # ... and of the frozen ones, those gathered again for a backward (ZeRO-3)
        self.A = costs.saved_prefix(redo_all)  # saved(a, e) = A[e] - A[a] + A0[a]
        self.A0 = costs.saved_at_start(redo_all)
        # what the prefix form misses (planner.cost.ranges' gap, nothing recomputed; the starts receiving a storage
        # apart, planner.cost.received): [a, e], None where nothing
        self.correction = costs.saved_correction(redo_all)
        speeds, held, links = rank_speeds(opts), held_counts(opts, self.m), boundary_links(opts)
        self.sigma = [speeds[opts.rank_of_stage(c)] for c in range(self.C)]
        device_caps = rank_caps(opts, profile)
        self.caps = [device_caps[opts.rank_of_stage(c)] if caps else None for c in range(self.C)]
        self.held = held
        self.beta_w, self.beta_t = static_factors(opts, profile.dtype)  # static bytes per (trainable) parameter byte
        # all-reduce seconds per trainable and per frozen parameter byte (per pass of gathers)
        self.ar_t, self.ar_f = sync_factors(opts, profile.dtype, self.m) if opts.data_parallel > 1 else (0.0, 0.0)
        self.ar = self.ar_t + self.ar_f  # 0: no data-parallel exchange
        cache: Dict[tuple, np.ndarray] = {}
        call = stage_call_s(profile, b)  # a stage's own cost per micro-batch, charged with its input

        def cuts(link, sigma: float = 0.0) -> np.ndarray:
            """Transfer times over `link` (None: no transfer), plus the call cost at speed sigma."""
            if (link, sigma) not in cache:
                times = np.array(cut_times(profile, b, opts, link) + [0.0]) if link is not None else np.zeros(self.L + 1)
                cache[link, sigma] = times + (call / sigma if sigma else 0.0)
            return cache[link, sigma]

        self.tin = [cuts(links[c - 1] if c > 0 else None, self.sigma[c]) for c in range(self.C)]
        self.tout = [cuts(links[c]) if c < self.C - 1 else cuts(None) for c in range(self.C)]

    # -- the band ---------------------------------------------------------------------------
    def build_band(self, tau_hi: float, deadline: Optional[float] = None) -> None:
        """Tables over starts a in [lo(e), e) for every end e; tau_hi = inf gives the full triangle.
        OutOfTime past `deadline` (time.perf_counter()): the last band's tables are then kept whole."""
        L, W = self.L, self.W
        ends = np.arange(L + 1)
        if math.isfinite(tau_hi) and self.monotone:
            reach = tau_hi * max(self.sigma) * (1 + 1e-9) + 1e-300
            lo = np.searchsorted(W, W - reach, side="left")
        else:
            lo = np.zeros(L + 1, dtype=int)
        lo = np.minimum(lo, np.maximum(ends - 1, 0))
        K = max(1, int(np.max(ends - lo)))
        a = ends[:, None] - 1 - np.arange(K)[None, :]
        valid = (a >= lo[:, None]) & (a >= 0)
        safe = np.where(valid, a, 0)
        base: Dict[tuple, np.ndarray] = {}
        tables: List[np.ndarray] = []
        raw: Dict[tuple, np.ndarray] = {}
        dP = self.P[ends][:, None] - self.P[safe]
        dA = self.A[ends][:, None] - self.A[safe] + self.A0[safe]
        if self.correction is not None:
            dA = dA + self.correction[safe, ends[:, None]]
        dT = self.T[ends][:, None] - self.T[safe]
        dFB = self.FB[ends][:, None] - self.FB[safe]
        static = dP * self.beta_w + dT * self.beta_t
        for c in range(self.C):
            check_deadline(deadline)
            key = (self.sigma[c], id(self.tin[c]), id(self.tout[c])) if self.added is None else ("stage", c)
            if key not in raw:
                t = (W[ends][:, None] - W[safe]) / self.sigma[c] + self.tin[c][safe] + self.tout[c][ends][:, None]
                if self.added is not None:
                    t = t + self.added[c][safe, ends[:, None]]
                raw[key] = np.where(valid, t, np.inf)
            full = key + (self.caps[c], self.held[c] if self.caps[c] is not None else 0)
            if full not in base:
                t = raw[key]
                if self.caps[c] is not None:
                    t = np.where(static + self.held[c] * dA <= self.caps[c], t, np.inf)
                base[full] = t
            tables.append(base[full])
        self.a_idx = np.where(valid, a, L + 1)  # L + 1: a sentinel whose DP value is +inf
        self.K, self.tables, self.raw = K, tables, raw
        self.extra = np.where(valid, self.ar_t * dT + self.ar_f * (dP - dT + dFB), np.inf)

    # -- dynamic programs on the band ---------------------------------------------------------
    def _masked(self, c: int, tau: float, eps: Optional[float]) -> np.ndarray:
        t = self.tables[c]
        if math.isfinite(tau):
            t = np.where(t <= tau, t, np.inf)
        if eps is not None:
            t = np.where(self.extra <= eps, t, np.inf)
        return t

    def _trace(self, choices: List[np.ndarray]) -> List[int]:
        bounds, e = [], self.L
        for arg in reversed(choices[1:]):
            e = int(self.a_idx[e, arg[e]])
            bounds.append(e)
        return sorted(bounds)

    def min_sum(self, tau: float, eps: Optional[float] = None) -> Tuple[float, Optional[List[int]]]:
        """g(tau, eps) on the band: (value, boundaries) or (inf, None)."""
        L = self.L
        best = np.full(L + 2, np.inf)
        best[0] = 0.0
        rows = np.arange(L + 1)
        choices = []
        for c in range(self.C):
            cand = best[self.a_idx] + self._masked(c, tau, eps)
            arg = np.argmin(cand, axis=1)
            best = np.append(cand[rows, arg], np.inf)
            choices.append(arg)
        if not math.isfinite(best[L]):
            return math.inf, None
        return float(best[L]), self._trace(choices)

    def min_max(self, which: str = "time", tau: float = math.inf) -> Tuple[float, Optional[List[int]]]:
        """Least possible max_c T_c (which='time') or max_c E_c ('extra', with T_c <= tau) on the band."""
        L = self.L
        best = np.full(L + 2, np.inf)
        best[0] = 0.0
        rows = np.arange(L + 1)
        choices = []
        for c in range(self.C):
            t = self._masked(c, tau, None)
            value = t if which == "time" else np.where(np.isfinite(t), self.extra, np.inf)
            cand = np.maximum(best[self.a_idx], value)
            arg = np.argmin(cand, axis=1)
            best = np.append(cand[rows, arg], np.inf)
            choices.append(arg)
        if not math.isfinite(best[L]):
            return math.inf, None
        return float(best[L]), self._trace(choices)

    def unconstrained_min_sum(self) -> float:
        """g_lb: min over all splits of sum_c T_c, ignoring caps (prefix minimum: O(C L))."""
        best = np.full(self.L + 1, np.inf)
        best[0] = 0.0
        for c in range(self.C):
            key = self.W / self.sigma[c]
            left = best - key + self.tin[c]  # value of starting stage c at a
            run = np.minimum.accumulate(left)  # min over a <= e - 1, shifted below
            new = np.full(self.L + 1, np.inf)
            new[1:] = run[:-1] + key[1:] + self.tout[c][1:]
            best = new
        return float(best[self.L])

    def split_values(self, bounds: List[int]) -> Tuple[float, float, float, bool]:
        """(sum T, max T, max E, inside the band and feasible) of a split, read from the tables."""
        edges = [0] + list(bounds) + [self.L]
        total, top, extra = 0.0, 0.0, 0.0
        for c in range(self.C):
            a, e = edges[c], edges[c + 1]
            j = e - 1 - a
            if not 0 <= j < self.K or self.a_idx[e, j] != a:
                return math.inf, math.inf, math.inf, False
            t = float(self.tables[c][e, j])
            total, top, extra = total + t, max(top, t), max(extra, float(self.extra[e, j]))
        return total, top, extra, math.isfinite(total)


def solve_chain(profile: Profile, b: int, opts: CostOptions, caps: bool = True,
                added: Optional[List[np.ndarray]] = None, deadline: Optional[float] = None) -> Optional[ChainResult]:
    """The exact optimum of the scenario's objective over splits (memory caps included unless
    caps=False; recomputation fixed: none, or all under recompute='all'; `added` adds a per-stage
    [a, e] time table, e.g. recomputation bounds); None when nothing fits. Past `deadline`
    (time.perf_counter()) the search stops with the best split found (`exact` False)."""
    chain = ChainScenario(profile, b, opts, caps, added)
    L, C, m = chain.L, chain.C, chain.m
    if not 1 <= C <= L:
        return None
    g_lb = chain.unconstrained_min_sum()
    eps_lb = (chain.ar_t * chain.T[L] + chain.ar_f * (chain.P[L] - chain.T[L] + chain.FB[L])) / C
    # tau*: the min-max over the band of a guess; a band built for tau holds every split whose
    # max T is <= tau, so the first guess >= the band's own min-max proves it is the true tau*.
    top_t = chain.W[L] / min(chain.sigma) + 2 * max(float(np.max(t)) for t in chain.tin + chain.tout)
    guess = max(chain.W[L] / (C * max(chain.sigma)), float(np.max(np.diff(chain.W))) / max(chain.sigma), 1e-300)
    def past() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    last = None  # the last complete band's (tau*, split): a start if the next band is not done in time
    try:  # at thousands of units one band takes seconds: past the deadline, the last band's split (or none)
        while True:
            chain.build_band(guess, deadline)
            tau_star, split = chain.min_max()
            last = (tau_star, split) if split is not None else last
            if split is not None and (tau_star <= guess or past()):  # (late: the band's min-max split, unproven)
                break
            if not math.isfinite(guess):
                if split is None:
                    return None
                break
            guess = tau_star if split is not None else guess * 4
            if guess >= top_t:
                guess = math.inf
    except OutOfTime:
        if last is None:
            return None
        tau_star, split = last  # read from the last band, whose tables stayed
    s, top, ex, _ = chain.split_values(split)
    best = (s + (m - 1) * top + ex, split)
    evaluations = [1]
    unproven = ChainResult(objective=best[0] + opts.step_overhead_s, boundaries=split, min_max=math.nan,
                           min_sum=g_lb, evaluations=1, exact=False)  # the min-max split, where time ran out
    if past():  # the tables of every range near the optimum take seconds at thousands of units
        return unproven
    tau_hi = best[0] if m == 1 else min(best[0], (best[0] - g_lb - eps_lb) / (m - 1))
    tau_hi = max(tau_hi, tau_star)
    try:
        chain.build_band(tau_hi, deadline)
    except OutOfTime:
        return unproven

    def consider(bounds: List[int]) -> Tuple[float, float, float]:
        total, t_max, e_max, ok = chain.split_values(bounds)
        nonlocal best
        if ok and total + (m - 1) * t_max + e_max < best[0]:
            best = (total + (m - 1) * t_max + e_max, bounds)
        return total + (m - 1) * t_max, t_max, e_max

    raw = np.concatenate([t[np.isfinite(t)] for t in chain.raw.values()])
    values = np.unique(raw[(raw >= tau_star) & (raw <= max(tau_hi, tau_star) * (1 + 1e-12))])
    if values.size == 0 or values[0] > tau_star:
        values = np.concatenate([[tau_star], values])

    def inner(eps: Optional[float]) -> Tuple[float, Optional[float]]:
        """Best F = sum + (m-1) max T with max E <= eps found (a lower bound on F_eps when pruned),
        and the max E of the split attaining it (None when F was only bounded)."""
        e_add = eps or 0.0
        found: Tuple[float, Optional[float]] = (math.inf, None)
        heap = [(-math.inf, 0, len(values) - 1, math.inf)]
        while heap and not late():
            _, lo, hi, g_right = heapq.heappop(heap)
            if m > 1:  # only thresholds with g_right + (m-1) tau + eps < U can improve
                limit = (best[0] * (1 + TOL) - e_add - (g_right if math.isfinite(g_right) else g_lb)) / (m - 1)
                hi = min(hi, int(np.searchsorted(values, limit, side="right")) - 1)
            if lo > hi or (math.isfinite(g_right) and g_right + (m - 1) * values[lo] + e_add >= best[0] * (1 - TOL)):
                continue
            mid = hi if not math.isfinite(g_right) else (lo + hi) // 2
            g, bounds = chain.min_sum(float(values[mid]), eps)
            evaluations[0] += 1
            if bounds is None:  # nothing at or below values[mid]
                heapq.heappush(heap, (g_right + (m - 1) * values[mid + 1] if mid + 1 <= hi else math.inf,
                                      mid + 1, hi, g_right))
                continue
            f, t_max, e_max = consider(bounds)
            if f < found[0]:
                found = (f, e_max)
            k = int(np.searchsorted(values, t_max, side="left"))
            heapq.heappush(heap, (g + (m - 1) * values[lo], lo, k - 1, g))
            if mid + 1 <= hi:
                heapq.heappush(heap, (g_right + (m - 1) * values[mid + 1], mid + 1, hi, g_right))
        return found

    stopped = [False]  # a loop ended on the deadline, not on its own

    def late() -> bool:
        stopped[0] = stopped[0] or (deadline is not None and time.perf_counter() > deadline)
        return stopped[0]

    if chain.ar == 0.0:
        inner(None)
    else:
        _outer(chain, inner, lambda: best[0], g_lb, tau_star, m, late)
    return ChainResult(objective=best[0] + opts.step_overhead_s, boundaries=best[1], min_max=tau_star, min_sum=g_lb,
                       evaluations=evaluations[0], exact=not stopped[0])


def _outer(chain: ChainScenario, inner, incumbent, g_lb: float, tau_star: float, m: int, late) -> None:
    """Branch and bound over eps (the max per-iteration all-reduce time), as the module docstring says."""
    eps_star, _ = chain.min_max("extra")
    if not math.isfinite(eps_star):
        return
    ext = chain.extra[np.isfinite(chain.extra)]
    eps_values = np.unique(ext[ext >= eps_star])
    base = g_lb + (m - 1) * tau_star
    heap = [(base + eps_values[0], 0, len(eps_values) - 1, base)]
    while heap and not late():
        bound, lo, hi, f_right = heapq.heappop(heap)
        limit = incumbent() * (1 + TOL) - f_right
        hi = min(hi, int(np.searchsorted(eps_values, limit, side="right")) - 1)
        if lo > hi or f_right + eps_values[lo] >= incumbent() * (1 - TOL):
            continue
        mid = (lo + hi) // 2
        eps = float(eps_values[mid])
        f, e_act = inner(eps)
        f_low = min(f, incumbent() - eps)  # F_eps(eps) >= this whatever was pruned
        right = mid - 1
        if f <= f_low and e_act is not None:
            right = int(np.searchsorted(eps_values, e_act, side="left")) - 1
        heapq.heappush(heap, (f_low + eps_values[lo], lo, right, max(f_low, f_right)))
        if mid + 1 <= hi:
            heapq.heappush(heap, (f_right + eps_values[mid + 1], mid + 1, hi, f_right))
