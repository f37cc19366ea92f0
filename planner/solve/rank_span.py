"""A bound on every split from each rank's span: the fill before its first compute, everything its list
does between its first and its last compute, and the drain after it.

Rank r runs stages G_r; g0 = min G_r. Its first compute is a forward, of a micro-batch that crossed every
stage before g0 first; under 1F1B-like lists its last compute is a backward, whose gradient crosses every
stage before g0 again. Between them the rank runs all its computes and the batches its list puts there, each
as planner.solve.rank_busy counts them (a blocking batch no sooner than its post plus its longest
transfer, every operation `message`). So for every split

    T >= fill_r(a_g0) + sum_{g in G_r} M_g(a_g, e_g) + drain_r(a_g0)

    fill_r(a)  = (F(0, a) + g0 k^f) / sigma_max + sum_{j < g0} min_{c <= a} (t^act_j(c) + message)
    drain_r(a) = (G(0, a) + g0 k^b) / sigma_max + sum_{j < g0} min_{c <= a} (t^grad_j(c) + message)
    M_g(a, e)  = m W(a, e) / sigma_r + A_g(a) + E_g(e) + n_g message   (the counts of the batches between)

(boundary j < g0 lies at a cut c <= a_g0; F, G the units' forward and backward work, recomputed forwards
in G under 'all'). Zero-bubble lists may end a rank on a weight backward nothing waits for: no drain, and
W(a, e) the forward plus each unit's cheaper backward case and the cheaper stage call (as the loose bound).

The same holds from any of the rank's computes on (an anchor): what its list runs from it on follows it.
Each rank has 2 v rows, T_{r,x}, one per anchor x: the first forward of each of its stages g (fill_r above
with g for g0: micro-batch 0 crossed every stage before g, fill(a_g)) and the first backward (whole, or
input part) of each (its micro-batch's forwards through every stage, then its backward down to g + 1:
before(a_g) + turn_g(e_g), the boundaries before g at cuts <= a_g and those from g on at cuts >= e_g, the
backwards of the stages after g as least as their parts can take). Each row counts the rank's computes from
its anchor on per stage and kind (later_counts: forward, whole backward, input and weight parts, a weight
part alone) and the batches between its anchor and its last compute, then the drain. Boundaries between two
stages of one rank cross nothing (zb-v's p - 1, p; every boundary at p = 1). The rows at the first forward
of g0 are T_r above.

The bound is the least over splits of max_rows T. Its Lagrangian: for weights lambda >= 0 on the rows
summing to 1, min over splits of sum lambda T is below it. W is additive (prefix sums) and a batch receiving an
activation and a gradient of one stage waits for the longer, at least their mean, so each stage's term is
u_g(e) + w_g(a) and that least is a dynamic program over the boundaries with prefix minima, O(S L). The
weights by cutting planes: each split found is a cut of the model max_lambda min_j lambda . T(split_j),
from the ranks' whole spans weighed alike.
"""
from __future__ import annotations

import time
from collections import defaultdict
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import numpy as np

from planner.cost.model import rank_speeds, step_shape
from planner.cost.options import CostOptions
from planner.cost.ranges import RangeCosts, prefix_sums
from planner.cost.step import StepShape
from planner.pipeline.actions import ActionKind
from planner.pipeline.schedule import ZERO_BUBBLE_SCHEDULES
from planner.solve.dual import SimplexMaster, highspy
from planner.solve.rank_busy import CutWaits, anchor_index, crossings_before, rank_busy, rank_items

ITERATIONS = 200  # cutting-plane steps at most (each O(S L) and a small linear program)
TOLERANCE = 1e-4  # relative: the model's maximum this close to the bound ends the ascent


class RankSpans:
    """Per stage g and per row i of its rank (its span from anchor i on, `anchors`: i = 0 its whole span;
    module docstring) the separable parts u_g(e), w_g(a), +inf where a stage cannot start (end) at that
    cut. Rank r's rows are r per_rank .. r per_rank + per_rank - 1."""

    def __init__(self, costs: RangeCosts, opts: CostOptions, m: int, num_units: int):
        L, S, p = num_units, opts.num_stages, opts.pipeline_ranks
        v = S // p
        speeds = rank_speeds(opts)
        fastest = max(speeds)
        zero_bubble = opts.schedule in ZERO_BUBBLE_SCHEDULES
        gs = np.arange(S)[:, None]
        before = crossings_before(costs, opts, ("act",))
        fill = before + (costs.F[None, :] + gs * costs.call_forward) / fastest
        redo_l = costs.again if opts.recompute == "all" else np.zeros(L)
        if zero_bubble:
            drain = np.zeros_like(fill)
            # a later stage's input part: the units before the first cut no gradient crosses (ranges' `whole`: a
            # stage starting there runs nothing in it)
            whole_from = next((a for a in range(1, L) if costs.whole[a]), L)
            back, back_call = prefix_sums(np.where(np.arange(L) < whole_from, costs.gi + redo_l, 0.0)), \
                min(costs.first_input, costs.later_input)
        else:
            drain = crossings_before(costs, opts, ("grad",)) + \
                (costs.G[None, :] + prefix_sums(redo_l) + gs * costs.call_backward) / fastest
            back, back_call = prefix_sums(costs.g + redo_l), costs.call_backward
        # before the first backward of stage g: its micro-batch's forwards through every stage (the boundaries
        # before g at cuts <= a_g, fill; from g on at cuts >= e_g) and its backward down to g + 1
        turn = crossings_before(costs, opts, ("act", "grad"), after=True) + \
            (costs.F[-1] + S * costs.call_forward + back[-1] - back[None, :] + (S - 1 - gs) * back_call) / fastest

        self.ranks = [opts.rank_of_stage(g) for g in range(S)]
        self.anchors = [(kind, c) for kind in ("F", "B") for c in range(v)]  # each rank's rows
        self.p, self.per_rank, self.S, self.L = p, len(self.anchors), S, L
        chunks = [sorted(g for g in range(S) if self.ranks[g] == r) for r in range(p)]
        parts = compute_parts(costs, opts)
        u = np.zeros((S, self.per_rank, L + 1))
        w = np.zeros((S, self.per_rank, L + 1))
        for i, anchor in enumerate(self.anchors):
            waits = CutWaits(rank_busy(opts, m, "between_computes", anchor), costs, opts, L)
            counts = later_counts(opts, m, anchor)
            for g, r in enumerate(self.ranks):
                for kind, n in counts[g].items():
                    prefix, call = parts[kind]
                    u[g, i] += n * prefix / speeds[r]
                    w[g, i] += n * (call - prefix) / speeds[r]
                u[g, i] += waits.end(g, 0.5)
                w[g, i] += waits.start(g, 0.5)
                if g == chunks[r][anchor[1]]:
                    w[g, i] += fill[g] if anchor[0] == "F" else before[g]
                    u[g, i] += turn[g] if anchor[0] == "B" else 0.0
                if g == chunks[r][0]:
                    w[g, i] += drain[g]
        self.u, self.w = u, w
        # each as its finite part and +inf where the stage cannot start (end) there (in any row): weighed fast
        self._finite_u, self._finite_w = np.where(np.isfinite(u), u, 0.0), np.where(np.isfinite(w), w, 0.0)
        self._mask_u = np.where(np.isfinite(u).all(axis=1), 0.0, np.inf)
        self._mask_w = np.where(np.isfinite(w).all(axis=1), 0.0, np.inf)

    def least(self, weights: np.ndarray) -> Tuple[float, List[int]]:
        """min over splits of sum_rows weights_row T_row, and a split reaching it (boundaries)."""
        L, k = self.L, self.per_rank
        best, choices = None, []
        for g, r in enumerate(self.ranks):
            lam = weights[r * k:(r + 1) * k]
            u, w = lam @ self._finite_u[g] + self._mask_u[g], lam @ self._finite_w[g] + self._mask_w[g]
            if best is None:
                here = u + w[0]
                here[0] = np.inf  # a stage holds a unit at least
            else:
                start = best + w
                arg = _prefix_argmin(start)  # a < e: the least over a <= e - 1
                here = np.full(L + 1, np.inf)
                here[1:] = start[arg[:-1]] + u[1:]
                choices.append(np.concatenate(([0], arg[:-1])))
            best = here
        value = float(best[L])
        boundaries, e = [], L
        for arg in reversed(choices):
            e = int(arg[e])
            boundaries.append(e)
        return value, sorted(boundaries)

    def spans(self, boundaries: List[int]) -> np.ndarray:
        """T of one split, per row."""
        starts, ends, k = [0] + list(boundaries), list(boundaries) + [self.L], self.per_rank
        out = np.zeros(self.p * k)
        for g, r in enumerate(self.ranks):
            out[r * k:(r + 1) * k] += self.u[g][:, ends[g]] + self.w[g][:, starts[g]]
        return out


def compute_parts(costs: RangeCosts, opts: CostOptions) -> Dict[str, Tuple[np.ndarray, float]]:
    """Per kind of compute in a rank's list, (prefix sums over the units of what it takes at least per
    micro-batch at speed 1, what its call adds at least): "F" a forward, "B" a whole backward (with the
    recomputed forward under 'all'), "IW" a zero-bubble micro-batch's input and weight parts together (each
    unit's cheaper case, least_work), "W" a weight part alone (whole or split, each unit's cheaper), "I" an
    input part alone (the first stage's runs nothing but its call)."""
    redo_l = costs.again if opts.recompute == "all" else np.zeros(len(costs.f))
    work, call = least_work(costs, opts)
    pair = (work - costs.F, call - costs.call_forward) if opts.schedule in ZERO_BUBBLE_SCHEDULES else \
        (prefix_sums(costs.g + redo_l), costs.call_backward)
    return {"F": (costs.F, costs.call_forward), "B": (prefix_sums(costs.g + redo_l), costs.call_backward),
            "IW": pair, "W": (prefix_sums(np.minimum(costs.g, costs.gw) + redo_l),
                              min(costs.first_call, costs.later_weight)),
            "I": (np.zeros(len(costs.f) + 1), min(costs.first_input, costs.later_input))}


def later_counts(opts: CostOptions, m: int, anchor: Tuple[str, int]) -> List[Dict[str, int]]:
    """Per stage, its computes in its rank's list from the rank's anchor on (rank_busy.anchor_index), by kind
    (compute_parts; a micro-batch's input and weight parts both there count once as "IW")."""
    return [dict(c) for c in _later_counts(step_shape(opts, m), anchor)]


@lru_cache(maxsize=1024)
def _later_counts(shape: StepShape, anchor: Tuple[str, int]) -> Tuple[Dict[str, int], ...]:
    """later_counts, fixed by the shape (cached)."""
    counts: List[Dict[str, int]] = [defaultdict(int) for _ in range(shape.num_stages)]
    for items in rank_items(shape):
        computes = [item for item in items[anchor_index(items, anchor):] if not isinstance(item, tuple)]
        weights = {(a.stage, a.micro_batch) for a in computes if a.kind == ActionKind.BACKWARD_WEIGHT}
        inputs = {(a.stage, a.micro_batch) for a in computes if a.kind == ActionKind.BACKWARD_INPUT}
        for a in computes:
            key = (a.stage, a.micro_batch)
            if a.kind == ActionKind.FORWARD:
                counts[a.stage]["F"] += 1
            elif a.kind == ActionKind.BACKWARD:
                counts[a.stage]["B"] += 1
            elif a.kind == ActionKind.BACKWARD_INPUT:
                counts[a.stage]["IW" if key in weights else "I"] += 1
            elif a.kind == ActionKind.BACKWARD_WEIGHT and key not in inputs:
                counts[a.stage]["W"] += 1
    return tuple(dict(c) for c in counts)


def least_work(costs: RangeCosts, opts: CostOptions) -> Tuple[np.ndarray, float]:
    """(prefix sums over the units of what a stage's forward and backward take at least per micro-batch at speed 1,
    what a stage's calls add at least): forward and backward with the recomputed forward under 'all'; zero-bubble
    lists each unit's cheaper backward case (whole, or both parts each with the recomputed forward) and the
    cheaper of the first stage's and a later stage's calls (planner.cost.ranges)."""
    redo_l = costs.again if opts.recompute == "all" else np.zeros(len(costs.f))
    if opts.schedule in ZERO_BUBBLE_SCHEDULES:
        per_unit = np.minimum(costs.g + redo_l, costs.gi + costs.gw + 2 * redo_l)
        return costs.F + prefix_sums(per_unit), costs.call_forward + min(costs.first_input + costs.first_call,
                                                                         costs.later_input + costs.later_weight)
    return costs.F + costs.G + prefix_sums(redo_l), costs.call_forward + costs.call_backward


def rank_span_bound(costs: RangeCosts, opts: CostOptions, m: int, num_units: int,
                    deadline: Optional[float] = None, iterations: int = ITERATIONS) -> float:
    """The Lagrangian bound of min over splits of max_r T_r (module docstring); 0 where S > L. The
    weights by cutting planes (planner.solve.dual's master: the splits found so far as cuts)."""
    if opts.num_stages > num_units or opts.replicated or highspy is None:
        return 0.0
    spans = RankSpans(costs, opts, m, num_units)
    master = SimplexMaster()
    rows = spans.p * spans.per_rank
    for _ in range(rows):
        master.add_form(np.zeros(0))
    # the first step weighs each rank's whole span alike (the other anchors' rows none)
    weights, model, bound, seen = np.zeros(rows), np.inf, 0.0, set()
    weights[::spans.per_rank] = 1.0 / spans.p
    for _ in range(iterations):
        value, boundaries = spans.least(weights)
        if not np.isfinite(value):
            return bound
        bound = max(bound, value)
        if model - bound <= TOLERANCE * bound or tuple(boundaries) in seen or \
                (deadline is not None and time.perf_counter() > deadline):
            break
        seen.add(tuple(boundaries))
        master.add_split(spans.spans(boundaries))
        weights, model = master.solve()
        if weights is None:
            break
    return bound


def _prefix_argmin(values: np.ndarray) -> np.ndarray:
    """[e]: an index a <= e of the least of values[:e + 1]."""
    running = np.minimum.accumulate(values)
    # the last index up to e where the running minimum was set: its value is the minimum at e
    idx = np.arange(len(values))
    marks = np.where(values == running, idx, 0)
    return np.maximum.accumulate(marks)
