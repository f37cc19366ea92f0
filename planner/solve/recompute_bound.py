"""The least time `--recompute auto` can add to a stage range so that it fits its device: a lower
bound, per stage and range, that lets the branch and bound over splits (planner.solve.branch) search
recomputation under a memory cap with one stage per device (1F1B, GPipe, zb-h1: below).

Stage g = [a, e) on rank i (speed sigma_i, cap c_i) holds M_g(a, e) bytes with nothing recomputed
(planner.cost.stage_memory.StageMemory.matrix), so it must free

    y_g(a, e) = (M_g(a, e) - c_i) / h_g        per held micro-batch (h_g: planner.cost.model.held_counts).

Recomputing unit l adds f_l / sigma_i to the stage's backward and frees at most h_g max(0, g_l(a, e))
(`freed_at_most`, below; a unit whose g_l < 0 costs bytes, frees none), so every
recomputation set that fits costs at least the covering knapsack's value, and at least its linear
relaxation's

    R_g(a, e) = min { sum_l f_l x_l : sum_l max(0, g_l(a, e)) x_l >= y_g(a, e), 0 <= x_l <= 1 } / sigma_i,

+inf where every unit of the range recomputed frees less than y (the range never fits). By duality,
for every rho >= 0

    phi(rho) = rho y - sum_{a <= l < e} max(0, rho max(0, g_l) - f_l)  <=  R sigma,

with equality at the ratio f_l / g_l where the cheapest cover per byte runs out. phi is concave and
piecewise linear with its breaks at the range's own ratios, so its largest value over a grid holding
every unit's ratio (in each of the positions a unit takes in a range: g_l differs at a range's first
and last unit) is the relaxation's value exactly; each cell finds it by bisection over the grid.
The sums over a range are prefix sums per grid point: the first unit, the units inside and the last
unit each take their own g (`freed_at_most`):

    first (e > a + 1): s_a - in_a + first_a - d_{a+1} + u_{a+1}    alone (e = a + 1): s_a - in_a + first_a
    inside:            s_l - in_l - d_{l+1} + u_{l+1} + r'_l         last (l = e - 1 > a): s_l - in_l + r'_l

(r'_l = max(p_l - d_l, q_l - u_l): what unit l shares with the unit before, recomputed or not, at most; the
pairs a set recomputes free no more than these sum to: planner.cost.ranges' p, u, q; where a stage starting
at some cut receives views of one storage apart, each of these the most over every start's terms, d - u the
least: planner.cost.received)

Whole units: a cover that needs a fraction of one large unit pays all of it (a stage that must free
60 MiB whose one useful unit frees 192 MiB). So each cell branches on one unit u of the range at the
relaxation's ratio: x_u = 1 costs f_u plus the rest covering y - g_u, x_u = 0 the rest covering y
(each again a relaxation: phi with u's term taken out), and the lesser of the two, when above the
relaxation, is the cell's value (still at most every whole-unit cover's time).

zb-h1 (one stage per device too) holds a second kind, "weight" (micro-batches between their input and
weight backward), whose terms change with recomputation beyond g_l (planner.cost.stage_memory.HeldTerms).
There each unit's bytes are `zero_bubble_kinds`: per position, with the counts in them, the most over
the rank's count vectors, at least what any set frees under the vector attaining M_g (its derivation
there), and y = M_g(a, e) - c_i; R_g is added to both backward parts (the input part's only where the
stage's input carries a gradient: the first stage's input part runs nothing).

A split's time with its best recomputation is at least its time with these added to each stage's
backward (the step is monotone in every duration); the split's own recomputation (chosen per stage,
planner.solve.recompute.recompute_for) gives an upper bound: the search treats the two as a leaf's
bound and value (planner.solve.branch).
"""
from __future__ import annotations

from typing import List

import numpy as np

from planner.cost.model import held_counts, num_micro_batches, rank_speeds
from planner.cost.options import CostOptions
from planner.cost.stage_memory import StageMemory
from planner.pipeline.schedule import ONE_STAGE_SCHEDULES
from planner.solve.chain_recompute import shared_redo_most

BLOCK = 1 << 16  # cells per bisection batch (each holds a few arrays of this many floats per grid lookup)


def bounded(opts: CostOptions) -> bool:
    """Whether the tables bound this scenario's recomputation: one stage per device (1F1B, GPipe, and
    zb-h1, whose weight kind the per-unit bytes of `zero_bubble_kinds` bound), not replicated."""
    return opts.recompute == "auto" and opts.schedule in ONE_STAGE_SCHEDULES + ("zb-h1",) \
        and opts.virtual_stages == 1 and not opts.replicated


def least_recompute(memory: StageMemory, costs, opts: CostOptions, b: int) -> List[np.ndarray]:
    """R_g[a, e] per stage g (seconds at the stage's speed; 0 where the range fits as it is, +inf where
    no recomputation makes it fit or e <= a)."""
    if opts.schedule == "zb-h1":
        least = _zero_bubble_cells(memory, costs)
    else:
        items, held = _Items.of(costs), held_counts(opts, num_micro_batches(opts, b))
        least = lambda g, a, e, over: items.least(a, e, over / max(held[g], 1))  # noqa: E731 (per held micro-batch)
    speeds = rank_speeds(opts)
    tables: List[np.ndarray] = []
    for g in range(opts.num_stages):
        M, cap = memory.matrix(g), memory.cap(g)
        table = np.where(np.isfinite(M), 0.0, np.inf)
        if cap is not None:
            a, e = np.nonzero(np.isfinite(M) & (M > cap))
            if len(a):
                table[a, e] = least(g, a, e, M[a, e] - cap) / speeds[opts.rank_of_stage(g)]
        tables.append(table)
    return tables


def _zero_bubble_cells(memory: StageMemory, costs):
    """zb-h1's relaxation per cell, least(g, a, e, over): the same knapsack over the bytes each unit frees at
    most under every count vector of the rank (`zero_bubble_kinds`, counts included: `over`, the stage's
    over-cap bytes, is not per micro-batch), by whether the stage starts where no input carries a gradient."""
    f = np.asarray(costs.f, dtype=float)
    items: dict = {}

    def least(g: int, a: np.ndarray, e: np.ndarray, over: np.ndarray) -> np.ndarray:
        out = np.empty(len(a))
        whole = np.ones(len(a), dtype=bool) if g == 0 else costs.whole[a].astype(bool)
        for kind in (True, False):
            cells = np.flatnonzero(whole == kind)
            if len(cells) == 0:
                continue
            kinds = zero_bubble_kinds(memory, g, kind)
            key = kinds.tobytes()
            if key not in items:  # (one at a time: at 1,000 units each holds ~0.1 GB of penalties)
                items.clear()
                items[key] = _Items(f, kinds)
            out[cells] = items[key].least(a[cells], e[cells], over[cells])
        return out
    return least


def zero_bubble_kinds(memory: StageMemory, g: int, whole: bool) -> np.ndarray:
    """[kind, l] (KINDS: alone, first, inside, last): at most what recomputing unit l frees of stage g's held
    bytes (planner.cost.stage_memory.HeldTerms, counts included) under zb-h1, in each position a unit takes
    in a range, the largest over the rank's count vectors, and at least 0; `whole`: the stage starts where
    no input carries a gradient (g == 0 always). What a set R frees under vector v (the stage's held bytes
    with none recomputed less with R, StageMemory.held's terms as planner.solve.ilp_memory writes them) is

        sum_{l in R} saves_l - [a in R, g > 0] first_recomputed_a + [e - 1 in R] last_unit_e
        - sum_{k - 1 in R, a < k < e} shared_lost_k + sum_{k - 1, k in R} pair_k          (neighbours)
        + fh_a [a holds h, a in R or (trained[e] = a) any of a .. e - 1 in R]            (first_holds - alone_shared)
        + sum_{l holds h, l not in R, l - 1 in R} after_recomputed_l
        + te_e [a <= trained[e], any of trained[e] .. e - 1 in R]                        (trained_end)
        + sum_{(k, T, x, h) applying, h in R} x                                          (inner_weight)

    and no more than sum_{l in R} of the unit's entry in its position: the pair's q - d share goes to its
    second unit (max(0, pair_k): with shared_lost_k on the first, at least each of the three cases), each
    indicator's positive part to every unit that may set it (fh to a first unit followed by frozen ones and to
    those frozen units; after_recomputed_{l+1} to unit l wherever it is not last; te_e to units trained[e] .. e - 1
    of any range: the most over the e it may end at; an inner pair's x to its holder h wherever it is)."""
    # the most over every start's terms too (a storage received apart: planner.cost.received)
    return np.maximum.reduce([_kinds(m, g, whole) for m in (memory, *memory.views.values())])


def _kinds(memory: StageMemory, g: int, whole: bool) -> np.ndarray:
    """`zero_bubble_kinds` under these terms alone (memory.views not read)."""
    c, L = memory.costs, memory.costs.num_units
    later = g > 0
    trains = np.asarray(c.t, dtype=float) > 0
    trained = np.asarray(c.trained, dtype=int)
    out = np.zeros((len(KINDS), L))
    for peak in memory.peaks[memory.ranks[g]]:
        t = memory.held(peak, g, whole)
        saves = np.asarray(t.recompute_saves, dtype=float)
        start = saves - (t.first_recomputed if later else 0.0)
        lost_next, last = t.shared_lost[1:L + 1], t.last_unit[1:L + 1]
        pair = np.maximum(t.pair, 0.0)
        fh = (t.first_holds - t.alone_shared) if later else np.zeros(L)
        after = np.append(np.maximum(t.after_recomputed[1:], 0.0), 0.0)  # unit l + 1's, to unit l
        # fh_a in the trained case: a first unit that trains followed by a frozen one (trained[a + 2] = a), and
        # the frozen units l after the trained t = trained[l + 1] < l of a stage starting at t
        fh_first = np.zeros(L)
        ok = np.flatnonzero(trained[2:] == np.arange(L - 1))
        fh_first[ok] = np.maximum(fh[ok], 0.0)
        tail_of = trained[1:]
        tail = (tail_of >= 0) & (tail_of < np.arange(L))
        fh_tail = np.where(tail, np.maximum(fh[np.maximum(tail_of, 0)], 0.0), 0.0)
        # te_e to units trained[e] .. e - 1: for unit l the most over e in [l + 1, the next unit that trains]
        te = np.maximum(t.trained_end, 0.0)
        te_best = np.zeros(L)
        for l in range(L - 1, -1, -1):
            te_best[l] = max(te[l + 1], te_best[l + 1] if l + 1 < L and not trains[l + 1] else 0.0)
        inner = np.zeros(L)
        for _, _, x, h in t.inner:
            if h >= 0 and x > 0:
                inner[h] += x
        common = te_best + inner
        kinds = np.stack([start + last + fh + common,
                          start - lost_next + after + fh_first + common,
                          saves + pair - lost_next + after + fh_tail + common,
                          saves + pair + last + fh_tail + common])
        np.maximum(out, kinds, out=out)
    return out


def zero_bubble_freed_at_most(memory: StageMemory, g: int, a: int, e: int) -> np.ndarray:
    """Per unit l = a .. e - 1 of stage g = [a, e) under zb-h1: at most what recomputing it frees of the
    stage's held bytes (`zero_bubble_kinds` in its position; the sum over a set at least what the set frees)."""
    whole = g == 0 or bool(memory.costs.whole[a])
    kinds = zero_bubble_kinds(memory, g, whole)
    position = np.full(e - a, 2)
    if e == a + 1:
        position[0] = 0
    else:
        position[0], position[-1] = 1, 3
    return kinds[position, np.arange(a, e)]


KINDS = ("alone", "first", "inside", "last")  # the positions a unit takes in a range (module docstring)
TIES = 4  # units kept per ratio: a cell branches on one of them that it holds (none found: no branching)


def _parts(costs):
    """Per unit: s_l - in_l, first_l, d_{l+1} - u_{l+1} (what it no longer shares with unit l + 1 recomputed;
    0 for the last unit) and r'_l (module docstring); where a stage receives a storage apart, the most (least:
    d - u, taken off) of these and its view's (planner.cost.received), as every start does."""
    parts = None
    for terms in (costs, *costs.views.values()):
        share = np.asarray(terms.shares, dtype=float)
        mine = (np.asarray(terms.s - terms.inputs, dtype=float), np.asarray(terms.first, dtype=float),
                np.append(share[1:, 0, 0] - share[1:, 1, 0], 0.0), shared_redo_most(terms))
        parts = mine if parts is None else tuple(
            most(x, y) for most, x, y in zip((np.maximum, np.maximum, np.minimum, np.maximum), parts, mine))
    return parts


def freed_at_most(costs, a: int, e: int) -> np.ndarray:
    """g_l(a, e), l = a .. e - 1, as the bound takes them (module docstring): what recomputing unit l in
    stage [a, e) frees at most, the sum over a recomputed set at least what it frees (planner.cost.ranges)."""
    live, first, dup_next, redo = _parts(costs)
    g = live[a:e].copy()
    g[0] += first[a]
    g[:-1] -= dup_next[a:e - 1]
    g[1:] += redo[a + 1:e]
    return g


class _Items:
    """The units as a covering knapsack's items over every range: their g in each position, the
    grid of ratios, the penalties' prefix sums per grid point (module docstring)."""

    @classmethod
    def of(cls, costs) -> "_Items":
        """The live kind's items, per held micro-batch (module docstring)."""
        live, first, dup_next, redo = _parts(costs)
        return cls(np.asarray(costs.f, dtype=float),
                   np.stack([live + first, live + first - dup_next, live - dup_next + redo, live + redo]))

    def __init__(self, f: np.ndarray, g: np.ndarray):
        """f: [l] each unit's forward; g: [kind, l] what it frees at most in each position (KINDS)."""
        self.f = f
        self.g = np.maximum(np.asarray(g, dtype=float), 0.0)  # [kind, l]
        useful = self.g > 0
        kind, unit = np.nonzero(useful)
        ratio = f[unit] / self.g[kind, unit]
        self.rho, where = np.unique(np.concatenate([[0.0], ratio]), return_inverse=True)
        where = where[1:]
        # per grid point, up to TIES (kind, unit) items of that ratio (-1: none)
        self.tied = np.full((len(self.rho), TIES, 2), -1)
        order = np.argsort(where, kind="stable")
        rank = np.zeros(len(where), dtype=int)
        sorted_where = where[order]
        starts = np.searchsorted(sorted_where, sorted_where, side="left")
        rank[order] = np.arange(len(where)) - starts
        keep = rank < TIES
        self.tied[where[keep], rank[keep]] = np.stack([kind[keep], unit[keep]], axis=1)
        # pen[kind][k, l] = max(0, rho_k g_l - f_l); inside: prefix sums over l (a range's inner units)
        self.pen = np.maximum(self.rho[None, :, None] * self.g[:, None, :] - f[None, None, :], 0.0)
        self.inside = np.concatenate([np.zeros((len(self.rho), 1)), np.cumsum(self.pen[2], axis=1)], axis=1)
        self.most = np.concatenate([[0.0], np.cumsum(self.g[2])])  # the same at rho -> inf: all freed

    def least(self, a: np.ndarray, e: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Per cell (a, e, y): the relaxation's value, raised by branching on one unit at its optimal
        ratio (module docstring), +inf where the range cannot free y."""
        out = np.full(len(a), np.inf)
        freed = self._freed(a, e)
        can = np.flatnonzero(freed >= y * (1 - 1e-12))  # the others never fit: +inf
        for lo_cell in range(0, len(can), BLOCK):
            cells = can[lo_cell:lo_cell + BLOCK]
            out[cells] = self._least(a[cells], e[cells], y[cells], freed[cells])
        return out

    def _freed(self, a, e):
        """What recomputing every unit of [a, e) frees per held micro-batch."""
        alone, last = e == a + 1, e - 1
        hi, lo = np.maximum(last, a + 1), a + 1
        return np.where(alone, self.g[0][a], self.g[1][a] + self.g[3][last] + self.most[hi] - self.most[lo])

    def _least(self, a, e, y, freed):
        alone, last = e == a + 1, e - 1
        hi, lo = np.maximum(last, a + 1), a + 1  # the inner units a+1 .. e-2 (none where e <= a + 2)
        pen, rho = self.pen, self.rho

        def ends(k):  # sum over the range of max(0, rho_k g_l - f_l)
            return np.where(alone, pen[0][k, a], pen[1][k, a] + pen[3][k, last] + self.inside[k, hi] - self.inside[k, lo])

        phi = lambda k, z=y: rho[k] * z - ends(k)  # noqa: E731
        k = self._argmax(phi, len(a))
        value = np.maximum(phi(k), 0.0)
        # branch on one unit u of the range at the optimal ratio: with it, f_u + the rest covering y - g_u;
        # without it, the rest covering y (x_u is 0 or 1, so the lesser of the two holds)
        kind, unit = self._held_item(k, a, e)
        found = kind >= 0
        kind_, unit_ = np.where(found, kind, 0), np.where(found, unit, 0)
        g_u, f_u = self.g[kind_, unit_], self.f[unit_]
        pen_u = lambda k: np.maximum(rho[k] * g_u - f_u, 0.0)  # noqa: E731
        without = lambda k: phi(k) + pen_u(k)  # noqa: E731
        rest = lambda k: phi(k) - rho[k] * g_u + pen_u(k)  # noqa: E731
        out_branch = np.where(freed - g_u >= y * (1 - 1e-12), without(self._argmax(without, len(a))), np.inf)
        in_branch = f_u + np.maximum(rest(self._argmax(rest, len(a))), 0.0)
        return np.where(found, np.maximum(value, np.minimum(in_branch, out_branch)), value)

    def _argmax(self, phi, n: int) -> np.ndarray:
        """Per cell, the grid index where the concave phi is largest (bisection)."""
        top = len(self.rho) - 1
        lo, hi = np.zeros(n, dtype=int), np.full(n, top)
        while True:
            open_ = lo < hi
            if not open_.any():
                return lo
            mid = (lo + hi) // 2
            rising = phi(np.minimum(mid + 1, top)) > phi(mid)
            lo = np.where(open_ & rising, mid + 1, lo)
            hi = np.where(open_ & ~rising, mid, hi)

    def _held_item(self, k, a, e):
        """(kind, unit) per cell: a unit of ratio rho_k in the position the range gives it, or (-1, -1)."""
        kind, unit = np.full(len(a), -1), np.full(len(a), -1)
        for t in range(TIES):
            c_kind, c_unit = self.tied[k, t, 0], self.tied[k, t, 1]
            position = np.select([e == a + 1, c_unit == a, c_unit == e - 1], [0, 1, 3], 2)
            inside = (c_unit >= a) & (c_unit < e) & (c_kind == position) & (c_unit >= 0)
            take = inside & (kind < 0)
            kind, unit = np.where(take, c_kind, kind), np.where(take, c_unit, unit)
        return kind, unit
