"""Per-stage cost matrices over unit ranges [a, e), from prefix sums (the DP's and heuristics' input).

For stage c on rank i = c % p at micro-batch size b, with prefix sums over units:

    time[c][a, e]   = (k + sum_{a<=l<e} f_l + g_l) / sigma_i + t_a^{c-1} [c > 0] + t_e^{c} [c < C-1]
                      (k: the profile's per-stage cost, planner.cost.model.stage_call_s)
    redo[c][a, e]   = sum_{a<=l<e} f_l / sigma_i            (extra time if every unit is recomputed)
    memory[c][a, e] = (P_e - P_a) beta + h_c (A_e - A_a)   (A: saved bytes, or inputs under 'all')
    extra[c][a, e]  = 2 (d - 1)/d (P_e - P_a) / dp_bandwidth

Entries with e <= a are +inf. Recomputation under 'auto' is a per-stage covering knapsack
(`cheapest_recompute`): the least extra time sum_{l in R} f_l / sigma_i such that
h_c sum_{l in R} (s_l - in_l) >= memory[c][a, e] - cap_i; it only ever lowers memory and raises
time, so the best plan recomputes the least that fits, independently per stage.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from planner.cost.model import (boundary_links, cut_times, held_counts, input_bytes, num_micro_batches, rank_caps,
                                rank_speeds, stage_call_s, static_factor, sync_time)
from planner.cost.options import CostOptions
from planner.profile.profile import Profile

EXACT_KNAPSACK_UNITS = 16  # recompute 'auto' in the DP/brute: enumerate subsets of at most this many units


def _prefix(values) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])


def _range(prefix: np.ndarray) -> np.ndarray:
    n = prefix.shape[0]
    out = prefix[None, :] - prefix[:, None]
    return np.where(np.triu(np.ones((n, n), dtype=bool), k=1), out, np.inf)


@dataclass
class StageTables:
    """Matrices indexed [a, e] for each stage c (lists of length C); caps per stage's rank."""

    time: List[np.ndarray]  # T_c without recomputation (or with all units recomputed under 'all')
    memory: List[np.ndarray]
    extra: List[np.ndarray]
    caps: List[Optional[float]]
    m: int


def stage_tables(profile: Profile, b: int, opts: CostOptions) -> StageTables:
    """The matrices above for a v = 1 or multi-stage plan (the stage's rank fixes speed, cap, links)."""
    L, C, p = profile.num_units, opts.num_stages, opts.pipeline_ranks
    m = num_micro_batches(opts, b)
    all_redo = opts.recompute == "all"
    work = _range(_prefix([u.forward_s[b] + u.backward_s[b] + (u.forward_s[b] if all_redo else 0.0)
                           for u in profile.units])) + stage_call_s(profile, b)
    saved = input_bytes(profile, b) if all_redo else [u.saved_bytes[b] for u in profile.units]
    params = _range(_prefix([u.param_bytes for u in profile.units]))
    acts = _range(_prefix(saved))
    speeds, caps, held, links = rank_speeds(opts), rank_caps(opts, profile), held_counts(opts, m), boundary_links(opts)
    static = params * static_factor(opts, profile.dtype)
    times, memories, extras = [], [], []
    for c in range(C):
        t = work / speeds[c % p]
        if c > 0:
            t = t + np.array(cut_times(profile, b, opts, links[c - 1]) + [0.0])[:, None]
        if c < C - 1:
            t = t + np.array(cut_times(profile, b, opts, links[c]) + [0.0])[None, :]
        times.append(t)
        memories.append(static + held[c] * acts)
        extras.append(sync_time(1.0, opts, profile.dtype, m) * params if opts.data_parallel > 1 else
                      np.where(np.isfinite(params), 0.0, np.inf))
    assert all(t.shape == (L + 1, L + 1) for t in times)
    return StageTables(time=times, memory=memories, extra=extras, caps=[caps[c % p] for c in range(C)], m=m)


def cheapest_recompute(profile: Profile, b: int, first: int, end: int, need_bytes: float, held: int,
                       speed: float, exact: bool = True) -> Optional[Tuple[float, List[int]]]:
    """Least extra time (and the units) freeing >= need_bytes of held * (s_l - in_l); None if impossible.

    exact: enumerate subsets (ValueError beyond EXACT_KNAPSACK_UNITS candidates); otherwise greedy by
    time per byte freed (a feasible, not always optimal, choice — used for warm starts only).
    """
    if need_bytes <= 0:
        return 0.0, []
    inputs = input_bytes(profile, b)
    items = [(profile.units[l].forward_s[b] / speed, held * (profile.units[l].saved_bytes[b] - inputs[l]), l)
             for l in range(first, end) if profile.units[l].saved_bytes[b] > inputs[l]]
    if sum(freed for _, freed, _ in items) < need_bytes:
        return None
    if not exact:
        chosen, freed, cost = [], 0.0, 0.0
        for t, f, l in sorted(items, key=lambda it: it[0] / it[1]):
            chosen.append(l)
            freed += f
            cost += t
            if freed >= need_bytes:
                break
        return cost, sorted(chosen)
    if len(items) > EXACT_KNAPSACK_UNITS:
        raise ValueError(f"exact recomputation choice over {len(items)} units of one stage is too large for "
                         f"the dp/brute methods (limit {EXACT_KNAPSACK_UNITS}); use --method ilp")
    best: Optional[Tuple[float, List[int]]] = None
    for r in range(1, len(items) + 1):
        for combo in itertools.combinations(items, r):
            if sum(f for _, f, _ in combo) >= need_bytes:
                cost = sum(t for t, _, _ in combo)
                if best is None or cost < best[0]:
                    best = (cost, sorted(l for _, _, l in combo))
    return best


def auto_recompute_times(profile: Profile, b: int, opts: CostOptions, tables: StageTables, exact: bool = True
                         ) -> List[np.ndarray]:
    """time[c] plus the cheapest recomputation making stage c fit its cap (+inf where nothing fits)."""
    L, p = profile.num_units, opts.pipeline_ranks
    speeds, held = rank_speeds(opts), held_counts(opts, tables.m)
    out = []
    for c, (t, mem, cap) in enumerate(zip(tables.time, tables.memory, tables.caps)):
        t = t.copy()
        if cap is not None:
            for a in range(L):
                for e in range(a + 1, L + 1):
                    if mem[a, e] > cap:
                        found = cheapest_recompute(profile, b, a, e, mem[a, e] - cap, held[c], speeds[c % p], exact)
                        t[a, e] = math.inf if found is None else t[a, e] + found[0]
        out.append(t)
    return out
