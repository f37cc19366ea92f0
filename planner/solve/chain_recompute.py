"""Recomputation bounds per stage range for the chain solver ('auto' recomputation under caps).

Stage c holding [a, e) on rank i (speed sigma, h_c micro-batches in flight) needs to free
need = M_c(a, e) - cap_i bytes. Recomputing unit l costs f_l / sigma and frees h_c g_l bytes
(g_l = s_l - in_l > 0). The cheapest cover is a covering knapsack

    R_c(a, e) = min { sum_{l in S} f_l / sigma : S in [a, e), h_c sum_{l in S} g_l >= need }.

With the units of [a, e) in increasing order of f_l / g_l (the same order for every c: sigma and
h_c scale all ratios alike) and prefix sums F_k (freed) and T_k (time) along it, k the first prefix
with h_c F_k >= need:

    lower: T_{k-1} + (need / h_c - F_{k-1}) / g_k f_k   (the fractional knapsack: a lower bound)
    upper: T_k                                          (greedy whole units: feasible)

both divided by sigma, +inf when even all of [a, e) does not free enough. Every stage time with
its best recomputation lies between T_c + lower and T_c + upper under the fill-drain form; the
chain optimum with the upper tables is a start for the exact search (planner.solve.dp.chain_start).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from planner.cost.model import held_counts, num_micro_batches, rank_caps, rank_speeds, static_bytes
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.profile.profile import Profile

MAX_UNITS = 200  # O(L^2 n) work per distinct (h_c, sigma, cap): used for profiles up to this size


def _unit_arrays(profile: Profile, b: int):
    """Per unit: forward time f, bytes saved by recomputing it g; prefix sums of parameter bytes P
    and of their trainable part T; the saved bytes A[a, e] of every range (nothing recomputed); the
    units worth recomputing, cheapest time per byte first."""
    costs, L = range_costs(profile, b), profile.num_units
    f, g, A = costs.f, costs.s - costs.inputs, costs.saved_matrix()
    items = np.array([l for l in range(L) if g[l] > 0], dtype=int)
    order = items[np.argsort(f[items] / g[items], kind="stable")] if items.size else items
    return f, g, costs.P, costs.T, A, order


def recompute_tables(profile: Profile, b: int, opts: CostOptions) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """(lower, upper) lists of (L+1) x (L+1) matrices [a, e] of recomputation time per stage."""
    L, C = profile.num_units, opts.num_stages
    m = num_micro_batches(opts, b)
    f, g, P, T, A, order = _unit_arrays(profile, b)
    n = order.size
    speeds, caps, held = rank_speeds(opts), rank_caps(opts, profile), held_counts(opts, m)
    static = static_bytes(P, T, opts, profile.dtype)  # prefix sums of the parameters' static bytes
    ends = np.arange(L + 1)
    cache = {}
    lower, upper = [], []
    for c in range(C):
        key = (held[c], speeds[opts.rank_of_stage(c)], caps[opts.rank_of_stage(c)])
        if key not in cache:
            cache[key] = _tables(L, n, order, f, g, static, A, *key, ends)
        lower.append(cache[key][0])
        upper.append(cache[key][1])
    return lower, upper


def recompute_range_tables(profile: Profile, b: int, opts: CostOptions, held: int, speed: float = 1.0,
                           holders: Optional[int] = None, extra: Optional[np.ndarray] = None
                           ) -> Tuple[np.ndarray, np.ndarray]:
    """(lower, upper) recomputation time [a, e] of a range holding `held` micro-batches on a device
    of this speed and the rank's cap, its stage on n holders (default d; planner.solve.replicas:
    one table per held count, `extra[a, e]` the bytes it holds beside them that recomputation does not free)."""
    L = profile.num_units
    f, g, P, T, A, order = _unit_arrays(profile, b)
    return _tables(L, order.size, order, f, g, static_bytes(P, T, opts, profile.dtype, holders), A, held, speed,
                   rank_caps(opts, profile)[0], np.arange(L + 1), extra)


def _tables(L, n, order, f, g, static, A, h, sigma, cap, ends, extra=None):
    low = np.full((L + 1, L + 1), np.inf)
    high = np.full((L + 1, L + 1), np.inf)
    for a in range(L):
        e = ends[a + 1:]
        need = (static[e] - static[a]) + h * A[a, e] + (0.0 if extra is None else extra[a, e]) - \
            (np.inf if cap is None else cap)
        fits = need <= 0
        low[a, e[fits]] = 0.0
        high[a, e[fits]] = 0.0
        if n == 0 or fits.all():
            continue
        inside = (order[None, :] >= a) & (order[None, :] < e[:, None])  # [e, rank in order]
        freed = np.cumsum(np.where(inside, g[order][None, :], 0.0), axis=1)
        spent = np.cumsum(np.where(inside, f[order][None, :], 0.0), axis=1)
        target = need / h
        enough = freed >= target[:, None]
        k = np.argmax(enough, axis=1)
        ok = enough[np.arange(e.size), k] & ~fits
        rows = np.arange(e.size)[ok]
        kk = k[ok]
        before_f = np.where(kk > 0, freed[rows, kk - 1], 0.0)
        before_t = np.where(kk > 0, spent[rows, kk - 1], 0.0)
        unit = order[kk]
        low[a, e[ok]] = (before_t + (target[ok] - before_f) / g[unit] * f[unit]) / sigma
        high[a, e[ok]] = spent[rows, kk] / sigma
    return low, high
