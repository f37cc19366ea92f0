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

The bound is the least over splits of max_r T_r. Its Lagrangian: for weights lambda_r >= 0 summing to 1,
min over splits of sum_r lambda_r T_r is below it. W is additive (prefix sums) and a batch receiving an
activation and a gradient of one stage waits for the longer, at least their mean, so each stage's term is
u_g(e) + w_g(a) and that least is a dynamic program over the boundaries with prefix minima, O(S L). The
weights by cutting planes: each split found is a cut of the model max_lambda min_j lambda . T(split_j).
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np

from planner.cost.model import rank_speeds
from planner.cost.options import CostOptions
from planner.cost.ranges import RangeCosts, prefix_sums
from planner.pipeline.schedule import ZERO_BUBBLE_SCHEDULES
from planner.solve.dual import SimplexMaster, highspy
from planner.solve.rank_busy import CutWaits, crossings_before, rank_busy

ITERATIONS = 200  # cutting-plane steps at most (each O(S L) and a small linear program)
TOLERANCE = 1e-4  # relative: the model's maximum this close to the bound ends the ascent


class RankSpans:
    """Per stage the separable parts u_g(e), w_g(a) of its rank's span (module docstring), +inf where a
    stage cannot start (end) at that cut."""

    def __init__(self, costs: RangeCosts, opts: CostOptions, m: int, num_units: int):
        L, S = num_units, opts.num_stages
        speeds = rank_speeds(opts)
        fastest = max(speeds)
        zero_bubble = opts.schedule in ZERO_BUBBLE_SCHEDULES
        work, call = least_work(costs, opts)
        g0s = np.arange(S)[:, None]
        fill = crossings_before(costs, opts, ("act",)) + (costs.F[None, :] + g0s * costs.call_forward) / fastest
        if zero_bubble:
            ends = fill
        else:
            redo = costs.AGAIN if opts.recompute == "all" else 0.0
            ends = fill + crossings_before(costs, opts, ("grad",)) + \
                (costs.G[None, :] + redo + g0s * costs.call_backward) / fastest

        waits = CutWaits(rank_busy(opts, m, "between_computes"), costs, opts, L)
        self.ranks = [opts.rank_of_stage(g) for g in range(S)]
        self.first = {}
        for g, r in enumerate(self.ranks):
            self.first.setdefault(r, g)
        self.p, self.S, self.L = opts.pipeline_ranks, S, L
        self.u: List[np.ndarray] = []
        self.w: List[np.ndarray] = []
        for g, r in enumerate(self.ranks):
            scale = m / speeds[r]
            self.u.append(scale * work + waits.end(g, 0.5))
            w = scale * (call - work) + waits.start(g, 0.5)
            if self.first[r] == g:
                w = w + ends[g]
            self.w.append(w)
        # each as its finite part and +inf where the stage cannot start (end) there: weighed fast
        self._finite_u = [np.where(np.isfinite(u), u, 0.0) for u in self.u]
        self._mask_u = [np.where(np.isfinite(u), 0.0, np.inf) for u in self.u]
        self._finite_w = [np.where(np.isfinite(w), w, 0.0) for w in self.w]
        self._mask_w = [np.where(np.isfinite(w), 0.0, np.inf) for w in self.w]

    def least(self, weights: np.ndarray) -> Tuple[float, List[int]]:
        """min over splits of sum_r weights_r T_r, and a split reaching it (boundaries)."""
        L = self.L
        best, choices = None, []
        for g, r in enumerate(self.ranks):
            u, w = self._finite_u[g] * weights[r] + self._mask_u[g], self._finite_w[g] * weights[r] + self._mask_w[g]
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
        """T_r of one split, per rank."""
        starts, ends = [0] + list(boundaries), list(boundaries) + [self.L]
        out = np.zeros(self.p)
        for g, r in enumerate(self.ranks):
            out[r] += self.u[g][ends[g]] + self.w[g][starts[g]]
        return out


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
    for _ in range(spans.p):
        master.add_form(np.zeros(0))
    weights, model, bound, seen = np.full(spans.p, 1.0 / spans.p), np.inf, 0.0, set()
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
