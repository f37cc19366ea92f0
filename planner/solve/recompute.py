"""Which units to recompute so that a split fits: a covering knapsack per stage.

Recomputing unit l in its stage's backward costs its forward f_l again and lowers what a held
micro-batch keeps from s_l (its saved bytes) to in_l (its input), so stage g holding h_g
micro-batches frees h_g g_l: g_l = s_l - in_l, corrected at the stage's ends for the storages
units share (planner.solve.chain_recompute.freed_bytes, as the cost model counts them). The
cheapest choice for a stage over its cap by `need` bytes is the least sum_{l in R} f_l / sigma
with h_g sum_{l in R} g_l >= need; it only ever lowers memory and raises time, so the best plan
recomputes the least that fits, stage by stage.
The exact model's memory (planner.cost.model) also holds received buffers, which recomputation
does not change; `recompute_for` aims at the over-cap bytes and the plan is evaluated again after.
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Tuple

from planner.cost.model import evaluate, held_counts, rank_speeds
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.profile.profile import Profile
from planner.solve.chain_recompute import freed_bytes

EXACT_KNAPSACK_UNITS = 16  # recompute 'auto' in the DP/brute: enumerate subsets of at most this many units


def cheapest_recompute(profile: Profile, b: int, first: int, end: int, need_bytes: float, held: int,
                       speed: float, exact: bool = True) -> Optional[Tuple[float, List[int]]]:
    """Least extra time (and the units) freeing >= need_bytes of held * g_l (chain_recompute.freed_bytes:
    s_l - in_l, corrected for shared storages); None if impossible.

    exact: enumerate subsets (ValueError beyond EXACT_KNAPSACK_UNITS candidates); otherwise greedy by
    time per byte freed, the slowest units needless at the end dropped (a feasible, not always optimal,
    choice: the warm starts, and the leaves of the branch and bound, which bounds them from below).
    """
    if need_bytes <= 0:
        return 0.0, []
    costs = range_costs(profile, b)
    freed = freed_bytes(costs, first, end)  # per held micro-batch, as the cost model counts the stage
    items = [(profile.units[l].forward_s[b] / speed, held * float(freed[l - first]), l)
             for l in range(first, end) if freed[l - first] > 0]
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
        # the last unit taken may make earlier ones needless: drop the slowest while the rest still fit
        times = {l: (t, f) for t, f, l in items}
        for l in sorted(chosen, key=lambda l: -times[l][0]):
            if freed - times[l][1] >= need_bytes:
                chosen.remove(l)
                freed -= times[l][1]
                cost -= times[l][0]
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


def recompute_for(profile: Profile, boundaries: List[int], b: int, opts: CostOptions, exact: bool = True
                  ) -> Optional[List[int]]:
    """The cheapest recomputation set making every stage of this split fit (None: impossible)."""
    L = profile.num_units
    if opts.recompute == "all":
        return list(range(L))
    plain = evaluate(profile, boundaries, b, opts)
    if opts.recompute == "none" or plain.feasible:
        return [] if plain.feasible else None
    if opts.virtual_stages != 1:
        return None
    if opts.schedule == "zb-h1":
        return _zero_bubble_recompute(profile, boundaries, b, opts, plain)
    speeds, held, chosen = rank_speeds(opts), held_counts(opts, plain.num_micro_batches), []
    for c, st in enumerate(plain.stages):
        cap = plain.device_caps[c]
        if cap is None or plain.device_memory[c] <= cap:
            continue
        found = cheapest_recompute(profile, b, st.first_unit, st.end_unit, plain.device_memory[c] - cap, held[c],
                                   speeds[c], exact)
        if found is None:
            return None
        chosen += found[1]
    return chosen


def _zero_bubble_recompute(profile: Profile, boundaries: List[int], b: int, opts: CostOptions, plain
                           ) -> Optional[List[int]]:
    """zb-h1 (one stage per device): per stage over its cap, its units by time per byte they free at most
    (planner.solve.recompute_bound.zero_bubble_freed_at_most, both count kinds), taken until those bytes
    cover the over-cap ones, then one more at a time while the cost model says the stage does not fit; the
    slowest needless ones dropped after. Recomputation frees less than those bytes where neighbours or a
    stage's tail interact, so the cost model decides; None where every such unit recomputed does not fit."""
    from planner.cost.model import compute_profile
    from planner.cost.stage_memory import StageMemory
    from planner.solve.recompute_bound import zero_bubble_freed_at_most

    memory = StageMemory(compute_profile(profile, opts), b, opts, False)
    chosen: List[int] = []
    for c, st in enumerate(plain.stages):
        cap = plain.device_caps[c]
        need = plain.device_memory[c] - cap if cap is not None else 0.0
        if need <= 0:
            continue
        a, e = st.first_unit, st.end_unit
        most = zero_bubble_freed_at_most(memory, c, a, e)
        f = memory.costs.f
        order = sorted((l for l in range(a, e) if most[l - a] > 0), key=lambda l: f[l] / most[l - a])
        if sum(most[l - a] for l in order) < need * (1 - 1e-12):
            return None
        fits = lambda redo: evaluate(profile, boundaries, b, opts, redo).device_memory[c] <= cap  # noqa: E731
        redo, covered, n = [], 0.0, 0
        while n < len(order) and covered < need:
            redo.append(order[n])
            covered += most[order[n] - a]
            n += 1
        while not fits(redo):
            if n == len(order):
                return None
            redo.append(order[n])
            n += 1
        for l in sorted(redo, key=lambda l: -f[l]):  # the slowest needless ones go
            rest = [u for u in redo if u != l]
            if fits(rest):
                redo = rest
        chosen += sorted(redo)
    return sorted(chosen)
