"""Recomputation bounds per stage range for the chain solver ('auto' recomputation under caps).

Stage c holding [a, e) on rank i (speed sigma, h_c micro-batches in flight) needs to free
need = M_c(a, e) - cap_i bytes. Recomputing unit l costs f_l / sigma and frees h_c g_l(a, e) bytes,
exactly as planner.cost.ranges counts a stage's saved bytes (`freed_bytes`):

    g_l(a, e) = s_l - in_l + [l = a] first_a - [l + 1 < e] d_{l+1} + [l > a] r_l

(the first unit's own input storages go with it; a storage unit l shares with unit l + 1 inside
the stage stays, as l + 1 saves it too; an input it keeps that unit l - 1 holds too, r_l, is held
once), additive over any set of recomputed units; in the terms a stage starting at a sees where it
receives views of one storage apart (planner.cost.received). The cheapest
cover is a covering knapsack

    R_c(a, e) = min { sum_{l in S} f_l / sigma : S in [a, e), h_c sum_{l in S} g_l(a, e) >= need }.

With the units of [a, e) with g_l(a, e) > 0 in increasing order of f_l / g_l(a, e) (the same order
for every c: sigma and h_c scale all ratios alike) and prefix sums F_k (freed) and T_k (time)
along it, k the first prefix with h_c F_k >= need:

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
from planner.pipeline.schedule import ZERO_BUBBLE_SCHEDULES
from planner.profile.profile import Profile
from planner.solve.floors import check_deadline

MAX_UNITS = 200  # O(L^2 n) work per distinct (h_c, sigma, cap): used for profiles up to this size


def freed_bytes(costs, a: int, e: int) -> np.ndarray:
    """g_l(a, e), l = a .. e - 1: the bytes one held micro-batch of stage [a, e) frees when unit l is
    recomputed (module docstring; the difference of planner.cost.ranges.RangeCosts.saved), in the terms a stage
    starting at a sees (a storage received apart there: planner.cost.received)."""
    costs = costs.at(a)
    g = (costs.s - costs.inputs)[a:e].astype(float)
    g[0] += costs.first[a]
    g[:-1] -= costs.dup[a + 1:e]
    g[1:] += costs.redo_dup[a + 1:e]
    # recomputing any of units l .. j of a gap in the stage counts its storage twice again (ranges' gap): each
    # takes it off, an upper bound of the bytes held where several of them are recomputed
    for l, j, x in costs.gaps:
        if a <= l and j < e:
            g[l - a:j - a + 1] -= x
    return g


def shared_redo_most(costs) -> np.ndarray:
    """r'_l = max(p_l - d_l, q_l - u_l): of what unit l, recomputed, shares with the unit before, what a stage
    holding both counts once beyond d_l, the unit before recomputed or not, at most (planner.cost.ranges' p, u,
    q; at least r_l, `freed_bytes`' additive count)."""
    share = costs.shares
    return np.maximum(share[:, 0, 1] - share[:, 0, 0], share[:, 1, 1] - share[:, 1, 0])


def frees_somewhere(costs) -> np.ndarray:
    """[l]: whether recomputing unit l frees bytes of the live kind in some stage (`freed_bytes`): the most
    it frees is as a stage's last unit (what it shares with the unit after it stays with that unit), first
    in it (its inputs as received go, first_l) or after another (what it keeps that the unit before holds
    too is held once, r_l; unit 0 only starts stage 0). A unit freeing nothing anywhere only adds time.
    Where the neighbours are recomputed too (planner.cost.ranges' p, u, q: what two units share as either
    or both are), at most r'_l after the unit before (`shared_redo_most`) and max(u - d, q - p) of unit l + 1's
    before it (0 where that one is not in the stage)."""
    out = np.zeros(costs.num_units, dtype=bool)
    for terms in (costs, *costs.views.values()):  # (and where a stage receives a storage apart: planner.cost.received)
        share = terms.shares
        after_another = np.where(np.arange(terms.num_units) > 0, shared_redo_most(terms), -np.inf)
        nxt = np.append(np.maximum(share[1:, 1, 0] - share[1:, 0, 0], share[1:, 1, 1] - share[1:, 0, 1]), 0.0)
        out |= terms.s - terms.inputs + np.maximum(terms.first, after_another) + np.maximum(nxt, 0.0) > 0
    return out


def worth_recomputing(costs, schedule: str) -> np.ndarray:
    """[l]: whether `--recompute auto` weighs recomputing unit l (the program's variables, brute force's
    sets): it frees bytes in some stage (`frees_somewhere`), or the schedule is zero bubble, where a
    unit's weight part holds other bytes (planner.cost.stage_memory); never a unit whose backward needs
    nothing (planner.cost.shared_storage.never_recomputed)."""
    return (frees_somewhere(costs) | (schedule in ZERO_BUBBLE_SCHEDULES)) & costs.recomputable


def recompute_tables(profile: Profile, b: int, opts: CostOptions) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """(lower, upper) lists of (L+1) x (L+1) matrices [a, e] of recomputation time per stage."""
    C = opts.num_stages
    m = num_micro_batches(opts, b)
    costs = range_costs(profile, b)
    saved = costs.saved_matrix()  # A[a, e]: nothing recomputed
    speeds, caps, held = rank_speeds(opts), rank_caps(opts, profile), held_counts(opts, m)
    static = static_bytes(costs.P, costs.T, opts, profile.dtype)  # prefix sums of the parameters' static bytes
    cache = {}
    lower, upper = [], []
    for c in range(C):
        key = (held[c], speeds[opts.rank_of_stage(c)], caps[opts.rank_of_stage(c)])
        if key not in cache:
            cache[key] = _tables(costs, saved, static, *key)
        lower.append(cache[key][0])
        upper.append(cache[key][1])
    return lower, upper


def recompute_range_tables(profile: Profile, b: int, opts: CostOptions, held: int, speed: float = 1.0,
                           holders: Optional[int] = None, extra: Optional[np.ndarray] = None,
                           target: Optional[np.ndarray] = None, deadline: Optional[float] = None
                           ) -> Tuple[np.ndarray, np.ndarray]:
    """(lower, upper) recomputation time [a, e] of a range holding `held` micro-batches on a device
    of this speed and the rank's cap, its stage on n holders (default d; planner.solve.replicas:
    one table per held count, `extra[a, e]` the bytes it holds beside them that recomputation does not
    free). `target[a, e]`, where given, replaces all that: the bytes each held micro-batch must free
    (<= 0: the range fits as it is; +inf: nothing makes it fit). OutOfTime past `deadline`
    (time.perf_counter(), read once per first unit a: O(L^2 log L) each, seconds in all at 1,000 units)."""
    costs = range_costs(profile, b)
    return _tables(costs, costs.saved_matrix(), static_bytes(costs.P, costs.T, opts, profile.dtype, holders), held,
                   speed, rank_caps(opts, profile)[0], extra, target, deadline)


def _tables(costs, A, static, h, sigma, cap, extra=None, per_sample=None, deadline=None):
    """(lower, upper) [a, e] for ranges holding h micro-batches (module docstring); `per_sample[a, e]`:
    the bytes each held micro-batch must free, given (recompute_range_tables' `target`). Only the ranges
    that do not fit as they are get the knapsack's sort (those that fit: 0)."""
    L, ends = costs.num_units, np.arange(costs.num_units + 1)
    f = costs.f
    per = 1 if per_sample is not None else h  # the micro-batches `need` is shared by
    low = np.full((L + 1, L + 1), np.inf)
    high = np.full((L + 1, L + 1), np.inf)
    for a in range(L):
        check_deadline(deadline)
        e = ends[a + 1:]
        if per_sample is not None:
            need = per_sample[a, e]
        else:
            need = (static[e] - static[a]) + h * A[a, e] + (0.0 if extra is None else extra[a, e]) - \
                (np.inf if cap is None else cap)
        fits = need <= 0
        low[a, e[fits]] = 0.0
        high[a, e[fits]] = 0.0
        if fits.all():
            continue
        e, need = e[~fits], need[~fits]  # the ranges that must recompute
        fits = np.zeros(e.size, dtype=bool)
        # g_l(a, e) for units l = a .. L - 1 (columns) of every range [a, e) (rows); 0 outside the range:
        # g_l(a, L), with a range's last unit keeping d_{l+1} (it shares it with a unit outside the range)
        ls = np.arange(a, L)
        inside = ls[None, :] < e[:, None]
        seen = costs.at(a)  # (a storage received apart at a: planner.cost.received)
        shared = np.append(seen.dup[a + 1:], 0.0)  # d_{l+1}: unit l shares with unit l + 1
        g = freed_bytes(costs, a, L)[None, :] + np.where(ls[None, :] + 1 == e[:, None], shared[None, :], 0.0)
        useful = inside & (g > 0)
        if not useful.any():
            continue
        ratio = np.where(useful, f[a:][None, :] / np.where(useful, g, 1.0), np.inf)
        if seen.first[a] == 0 and not seen.dup[a + 1:].any():  # one order for every range
            order = np.broadcast_to(np.argsort(ratio[-1], kind="stable"), ratio.shape)
        else:
            order = np.argsort(ratio, axis=1, kind="stable")  # per range, cheapest time per byte first
        g_sorted = np.take_along_axis(np.where(useful, g, 0.0), order, axis=1)
        f_sorted = np.take_along_axis(np.where(useful, f[a:][None, :], 0.0), order, axis=1)
        freed, spent = np.cumsum(g_sorted, axis=1), np.cumsum(f_sorted, axis=1)
        target = need / per
        enough = freed >= target[:, None]
        k = np.argmax(enough, axis=1)
        ok = enough[np.arange(e.size), k] & ~fits
        rows = np.arange(e.size)[ok]
        kk = k[ok]
        before_f = np.where(kk > 0, freed[rows, kk - 1], 0.0)
        before_t = np.where(kk > 0, spent[rows, kk - 1], 0.0)
        low[a, e[ok]] = (before_t + (target[ok] - before_f) / g_sorted[rows, kk] * f_sorted[rows, kk]) / sigma
        high[a, e[ok]] = spent[rows, kk] / sigma
    return low, high
