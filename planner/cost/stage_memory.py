"""A stage's memory as a function of where it starts and ends: the one definition the integer
program's memory rows (planner.solve.ilp), the branch and bound's fitting stages (planner.solve.branch)
and the memory floor of an infeasible request (planner.solve.diagnose) are written from.

Stage g holding units [a, e), under one of its rank's held-count vectors P (planner.cost.step.rank_peaks:
how many of each kind its list holds at one moment; planner.cost.rank_memory.held_bytes prices the same
kinds for one split), holds

    static(a, e)                                       its parameters' bytes (planner.cost.model.static_bytes)
    + sum_{a<=l<e} (P_live,g (saved_l - d_l) + P_weight,g weight_l)  per unit
    + [g > 0]     (P_inbox,g act_a + P_sent_grad,g grad_a + P_live,g d_a)   at the cut it starts at
    + P_live,g first_a + P_weight,g first'_a                       its first unit's inputs as received
    + [g < S - 1] (P_gradbox,g grad_e + P_sent_act,g act_e)          at the cut it ends at
    + [not whole] P_weight,g inner(a, e)       values it computes from its parameters (planner.cost.inner_weight)
    - (P_live,g + [whole] P_weight,g) gap(a, e)    storages two units that are not neighbours save, once
                                                   (planner.cost.ranges; pairs (l, j) none of l .. j recomputed)

(first_a, first'_a: planner.cost.ranges; first'_a is first_a where the weight kind counts saved_l + k_l, and
the first unit's measured difference in h_l where it counts h_l: where a later stage's first unit holds
its h under the zero-bubble weight kind, with the kept gradients measured, `first_holds` adds
first'_a - first_a.)

less, for the tied weights (planner.cost.ties), the static bytes of the copies its units count beyond
the one its rank holds (`tie_static` per copy; plus `tie_whole` - `tie_static` where the rank keeps it
whole under ZeRO, ties.kept_whole): `range_static_surplus` for a stage alone on its rank (in `matrix`
and `row`), (k_i - h_i) copies of each for a rank of several stages (the integer program).

saved_l (weight_l): what unit l keeps for its backward (until its weight backward: saved_l in the
first stage, whose input part runs nothing, which also holds the gradient received at the cut it
ends at, planner.cost.ranges; so does a later stage starting at a cut no gradient crosses, ranges'
`whole`: `held`'s `whole`, per start in `matrix`), its input in_l alone when every unit is recomputed;
d_l what unit l
and the unit before both save (counted once in a stage holding both; none when every unit is
recomputed). In the weight kind saved_l, d_l and the recomputed unit's inputs are what autograd still
holds as the forward returns (planner.cost.ranges' x_l, d^h_l, in^h_l, r^h_l). Under zero-bubble schedules, with the kept gradients measured, a later stage's
weight_l is saved_l + k_l for each unit but its last, whose h_l comes in at the cut the stage ends
at (`last_unit`); where the stage ends in frozen units after its last trained unit t and holds t, t holds
h_t and the frozen ones their h (`trained_end`, by the cut it ends at; planner.cost.ranges). Recomputing unit l alone (recompute 'auto') saves P_live,g (s_l - in_l) +
P_weight,g (h_l - in_l) (s_l - in_l in a later stage's weight kind so measured), gives back d_{l+1} - u_{l+1}
(`shared_lost`) where unit l + 1 is in its stage, frees p_l - d_l (what it keeps that unit l - 1 holds too,
planner.cost.ranges) but where it starts the stage (`first_recomputed`), where it frees first_a (and
first'_a) instead, and, the stage's last, cancels its `last_unit`; units l - 1 and l both recomputed hold
q_l + d_l - p_l - u_l less than those count (`pair`). Every unit recomputed, saved_l is in_l - q_l and a
stage gives q_a back at its start.
A stage starting at a cut where it receives views of one storage apart holds these terms of the units as it
receives them (planner.cost.received: the costs' view there, `views`; its row of `matrix` is that view's, and
the program adds the difference where the stage starts there). A rank's peak is the largest over its vectors;
with several stages on a rank the sum over them per vector. The fixed bytes every device holds are not in it:
compare with planner.cost.model.rank_caps (the caps less those).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import numpy as np

from planner.cost.inner_weight import Pair, inner_rows
from planner.cost.model import num_micro_batches, step_shape
from planner.cost.rank_memory import rank_caps, static_factors
from planner.cost.options import CostOptions
from planner.cost.ranges import prefix_sums, range_costs
from planner.cost.step import rank_peaks
from planner.cost.ties import copy_static, range_static_surplus, tie_copies, tied_weights
from planner.profile.profile import Profile


@dataclass(frozen=True)
class HeldTerms:
    """Stage g's held bytes under one count vector, linear in the split (module docstring)."""

    per_unit: np.ndarray  # [l]: bytes unit l adds when in the stage
    at_start: np.ndarray  # [k]: bytes when the stage starts at cut k (the first stage: at 0)
    at_end: np.ndarray  # [k]: bytes when the stage ends at cut k (0 for the last stage)
    recompute_saves: np.ndarray  # [l]: bytes recomputing unit l saves (recompute 'auto')
    # [k]: bytes back when unit k - 1 is recomputed with unit k in the stage (what they both saved,
    # counted once in per_unit, is then held twice, but what unit k saves of unit k - 1's kept inputs:
    # d_k - u_k, planner.cost.ranges)
    shared_lost: np.ndarray
    # [e], of at_end: the last unit's correction of a later stage's weight kind (h - s - k of unit
    # e - 1), which does not apply when that unit is recomputed (it holds its input alone)
    last_unit: np.ndarray
    # [l]: bytes back when unit l is recomputed and starts a stage g > 0: p_l - d_l (what it keeps, held once
    # with the unit before, is in recompute_saves) less its inputs as received (first_a, in at_start),
    # which it then holds no more (planner.cost.ranges); stage 0's unit 0 has its first_0 in recompute_saves
    first_recomputed: np.ndarray
    # [e]: bytes added at the cut e the stage ends at where it holds unit trained[e] (its last unit with a
    # trained parameter, before its last unit) and recomputes none of units trained[e] .. e - 1: that
    # unit then holds its h, the frozen ones after it theirs (planner.cost.ranges); 0 where not so
    trained_end: np.ndarray
    # [a]: bytes added where the stage starts at unit a, a holds its h (the stage's only unit, or its last
    # trained unit ending it in frozen ones: trained[e] = a) and is not recomputed: a later stage's weight
    # kind then counts its inputs as received by h, first'_a, not first_a (planner.cost.ranges)
    first_holds: np.ndarray
    # [l]: bytes back where unit l holds its h (the stage's last unit, or its last trained one ending it in
    # frozen units), is not recomputed, and shares nothing with a unit before it that the stage counts: it
    # starts the stage or that unit is recomputed. `last_unit` and `trained_end` count it as holding, of
    # what it shares with that unit, what it let go too (d^h_l - d'_l, planner.cost.ranges)
    alone_shared: np.ndarray
    # [l]: bytes back where unit l holds its h and is not recomputed, and unit l - 1 is: alone_shared less what it
    # still holds of what unit l - 1 keeps recomputed (u^h_l - u'_l, planner.cost.ranges)
    after_recomputed: np.ndarray
    # [k]: bytes less where units k - 1 and k are both in the stage and both recomputed, beyond what
    # recompute_saves and shared_lost count (q_k + d_k - p_k - u_k per kind: planner.cost.ranges)
    pair: np.ndarray
    # (k, T, bytes, h): these bytes more where the stage holds units T and k and does not recompute h (if h >= 0: a
    # value of source T its units read carries no gradient from its inputs: planner.cost.inner_weight); none
    # where whole, and no h >= 0 where every unit is recomputed
    inner: Tuple[Pair, ...] = ()
    # (l, j, bytes): these bytes less where the stage holds units l and j and recomputes none of l .. j (a storage
    # both save that no unit between them does: planner.cost.ranges' gap); none where every unit is recomputed
    gaps: Tuple[Tuple[int, int, float], ...] = ()


class StageMemory:
    """Every stage's memory terms of one scenario at micro-batch size b (module docstring)."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, recompute_all: bool):
        costs = range_costs(profile, b, opts.optimizer)
        self.S = opts.num_stages
        self.factors: Tuple[float, float] = static_factors(opts, profile.dtype)
        beta_w, beta_t = self.factors
        self.static_per_unit = costs.p * beta_w + costs.t * beta_t
        self._static = prefix_sums(self.static_per_unit)
        self.recompute_all = recompute_all
        self._derive(costs)
        self.ranks = [opts.rank_of_stage(g) for g in range(self.S)]
        self.peaks = rank_peaks(step_shape(opts, num_micro_batches(opts, b)))
        self.caps: List[Optional[float]] = rank_caps(opts, profile)  # per rank, less the fixed bytes
        self.ties = tie_copies(tied_weights(profile), costs)  # frozen ones too
        self.tie_static = copy_static(self.ties, self.factors)  # one copy's static bytes, per tie
        self.tie_whole = copy_static(self.ties, static_factors(opts, profile.dtype, 1))  # kept whole (kept_whole)
        self.shard = opts.shard
        # {a: StageMemory}: the terms of a stage starting at cut a where it receives a storage apart (the costs'
        # view there, planner.cost.received)
        self.views: Dict[int, "StageMemory"] = {a: self._view(view) for a, view in costs.views.items()}

    def _view(self, costs) -> "StageMemory":
        """These terms with `costs` (a start's view: planner.cost.received), its own views none."""
        view = copy.copy(self)
        for name in ("_held_less", "trained_correction"):  # (cached from these costs)
            vars(view).pop(name, None)
        view._derive(costs)
        view.views = {}
        return view

    def at(self, a: int) -> "StageMemory":
        """The terms a stage starting at unit a holds: its view where it receives a storage apart, else these."""
        return self.views.get(a, self)

    def _derive(self, costs) -> None:
        """The per-unit and per-cut terms read from the range costs (module docstring)."""
        self.costs = costs
        recompute_all = self.recompute_all
        # per unit, less what it shares with the unit before (d_l), given back at a stage's start
        # (every unit recomputed: its input, less q_l, what the unit before, recomputed, keeps too)
        both, held_both = costs.shares[:, 1, 1], costs.held_shares[:, 1, 1]
        self.saved = costs.inputs - both if recompute_all else costs.s - costs.dup
        # [k], k = 0 .. L: d_k (q_k), given back where a stage starts
        self.dup_at_cut = np.append(both if recompute_all else costs.dup, 0.0)
        # the same, of what autograd still holds as the forward returns (the weight kinds': x_l, d^h_k, q^h_k)
        self.held_saved = costs.held_inputs - held_both if recompute_all else \
            costs.s - costs.dropped - costs.held_dup
        self.held_dup_at_cut = np.append(held_both if recompute_all else costs.held_dup, 0.0)
        self.weight = costs.held_weight_inputs if recompute_all else costs.h
        # a later stage's weight kind, each unit but its last holding all it saved (planner.cost.ranges)
        self.kept = costs.kept_known and not recompute_all
        # every unit recomputed, the kept gradients measured: a later stage's weight kind holds each unit's in'^h_l
        # and k_l, the q^h_k it shares with the unit before once (given back at its start: held_dup_at_cut)
        self.kept_all = costs.kept_known and recompute_all
        if self.kept_all:
            self.weight = costs.held_weight_inputs + costs.k - held_both

    def cap(self, g: int) -> Optional[float]:
        """What stage g's rank may hold besides the fixed bytes (None: no cap)."""
        return self.caps[self.ranks[g]]

    def held(self, peak: Dict, g: int, whole: Optional[bool] = None) -> HeldTerms:
        """Stage g's terms under the count vector `peak` of its rank; `whole`: the stage starts where no
        input carries a gradient, so its weight part is its whole backward (planner.cost.ranges' `whole`:
        the first stage's terms; None: g == 0)."""
        c = self.costs
        whole = g == 0 if whole is None else whole
        count = lambda kind: peak.get((kind, g), 0)  # noqa: E731
        zero = np.zeros_like(c.act)
        # the first stage (and any whose inputs need no gradient) holds everything saved, and the gradient
        # its outputs received, until its weight part; a later one, measured so, all each unit saved and
        # kept but its last unit, which holds h (`last`, by the cut the stage ends at) (planner.cost.ranges)
        last = np.zeros_like(c.act)
        trained_end = np.zeros_like(c.act)
        first_holds = np.zeros_like(c.first)
        alone_shared = np.zeros_like(c.first)
        after_recomputed = np.zeros_like(c.first)
        # what a unit holds between the parts of the weight kind that counts what it saves: less what
        # autograd freed as the forward returned (x_l; planner.cost.ranges' held_saved)
        kept_saved = c.s - c.dropped
        if whole:
            weight, held = self.held_saved, kept_saved
        elif self.kept:
            weight, held = self.held_saved + c.k, kept_saved + c.k
            # (and of what it shares with the unit before, what its input part let go: d^h - d', planner.cost.ranges;
            # given back where it shares nothing counted with a unit before it: `alone_shared`)
            last[1:] = count("weight") * (self._held_less - c.weight_dup)
            trained_end = count("weight") * self.trained_correction
            first_holds = count("weight") * (c.first_held - c.first)
            alone_shared = count("weight") * (c.held_dup - c.weight_dup)
            # (after a recomputed unit it shares u^h with it, of which it still holds u': planner.cost.ranges)
            after_recomputed = alone_shared - count("weight") * (c.held_shares[:, 1, 0] - c.weight_shares[:, 1])
        else:
            weight, held = self.weight, c.h
        # the kinds that hold what units save, whose neighbours' shared bytes count once (d_k in the live
        # kind; in the weight kind what both still hold, d^h_k)
        live_share, weight_share = count("live"), (count("weight") if whole or self.kept or self.kept_all else 0)
        start_share = live_share * self.dup_at_cut + weight_share * self.held_dup_at_cut
        start = count("inbox") * c.act + count("sent_grad") * c.grad + start_share if g > 0 else zero
        # the first unit's inputs as received (planner.cost.ranges' first_a), none when recomputed
        first = np.zeros_like(c.first)
        if not self.recompute_all:
            first_weight = c.first_held if not whole and not self.kept else c.first
            first = count("live") * c.first + count("weight") * first_weight
            start = start + np.append(first, 0.0)
        end = count("gradbox") * c.grad + count("sent_act") * c.act if g < self.S - 1 else zero
        if whole and g < self.S - 1:
            end = end + count("weight") * c.grad
        # a recomputed unit holds its input (and, in a later stage's weight kind, its kept gradients)
        kept = c.k if not whole and self.kept else 0.0
        # (a later stage's input part freed what the loss saved: planner.cost.ranges' in'_l; none of it
        # where the unit attaches to no graph)
        weight_inputs = c.held_inputs if whole else c.held_weight_inputs
        saves = count("live") * (c.s - c.inputs) + count("weight") * (held - weight_inputs - kept)
        # what unit l, recomputed, shares with the unit before beyond d_l (p_l - d_l: planner.cost.ranges); with
        # unit l - 1 recomputed, not unit l, they share u_l, not d_l (`shared_lost`); both recomputed, q_l
        # (`pair`: what is then held less than those two changes count)
        share = lambda x, y: live_share * c.shares[:, x, y] + weight_share * c.held_shares[:, x, y]  # noqa: E731
        redo_dup = np.zeros_like(c.redo_dup) if self.recompute_all else share(0, 1) - share(0, 0)
        shared_lost = np.append(share(0, 0) - share(1, 0), 0.0)
        pair = np.zeros_like(c.redo_dup) if self.recompute_all else \
            share(1, 1) + share(0, 0) - share(0, 1) - share(1, 0)
        saves = saves + redo_dup
        if g == 0:  # unit 0 starts stage 0
            saves[0] += first[0]
        # storages two units that are not neighbours save: the live kind's, and the weight kind's where it counts
        # what units save (a whole stage; a later one's last unit holds its h: not counted, planner.cost.ranges)
        gaps: Dict[Tuple[int, int], float] = {}
        if not self.recompute_all:
            for table, n in ((c.gaps, live_share), (c.held_gaps, count("weight") if whole else 0)):
                for l, j, x in table:
                    gaps[l, j] = gaps.get((l, j), 0.0) + n * x
        return HeldTerms(count("live") * self.saved + count("weight") * weight, start, end + last, saves,
                         shared_lost, last,
                         first_recomputed=redo_dup - first, trained_end=trained_end, first_holds=first_holds,
                         alone_shared=alone_shared, after_recomputed=after_recomputed, pair=pair,
                         inner=() if whole else tuple((k, t, count("weight") * x, h) for k, t, x, h in c.inner
                                                      if h < 0 or not self.recompute_all),
                         gaps=tuple((l, j, x) for (l, j), x in gaps.items() if x))

    @cached_property
    def _held_less(self) -> np.ndarray:
        """Per unit: h_l less what a later stage's weight kind (kept gradients measured) counts for it,
        all it saved and kept less what it shares with the unit before (planner.cost.ranges)."""
        return self.costs.h - (self.held_saved + self.costs.k)

    @cached_property
    def trained_correction(self) -> np.ndarray:
        """[e]: what a later stage's weight kind (kept gradients measured) holds less, per count, where
        it ends at cut e in frozen units after its last trained unit t = trained[e] and holds t (none of
        t .. e - 1 recomputed): t holds h_t (less what it shares with the unit before and let go, d'_t),
        each unit after it its h_l, against `per_unit` and `last_unit`'s count (planner.cost.ranges).
        Where t starts the stage, or follows a recomputed unit, `alone_shared` gives d^h_t - d'_t back."""
        c, less = self.costs, self._held_less
        out = np.zeros_like(c.act)
        for e in range(1, c.num_units + 1):
            t = int(c.trained[e])
            if 0 <= t < e - 1:  # t and each unit after it hold their h, where `last_unit` had e - 1 alone
                out[e] = less[t] - c.weight_dup[t] + float(less[t + 1:e].sum()) - (less[e - 1] - c.weight_dup[e - 1])
        return out

    def matrix(self, g: int) -> np.ndarray:
        """M_g[a, e]: bytes stage g = [a, e) holds with nothing else on its rank (+inf where e <= a)."""
        return self._rows(g, None)

    def row(self, g: int, a: int) -> np.ndarray:
        """M_g[a, e] over e: one row of `matrix` (+inf where e <= a), without the whole table."""
        return self._rows(g, [a])[0]

    def _rows(self, g: int, starts: Optional[List[int]]) -> np.ndarray:
        """The rows of `matrix` for the starts a in `starts` (every cut 0..L for None)."""
        cuts = np.arange(len(self._static))
        first = cuts if starts is None else np.asarray(starts)
        static = np.where(cuts[None, :] > first[:, None], self._static[None, :] - self._static[first][:, None], np.inf)
        held = np.zeros_like(static)  # the largest over the rank's count vectors, and at least 0
        # a start whose inputs need no gradient: the first stage's terms (planner.cost.ranges' `whole`)
        whole = np.ones(len(first), dtype=bool) if g == 0 else self.costs.whole[first].astype(bool)
        for kind in (True, False):
            rows = np.flatnonzero(whole == kind)
            if len(rows) == 0:
                continue
            best = held if len(rows) == len(first) else np.zeros((len(rows), len(cuts)))
            for peak in self.peaks[self.ranks[g]]:
                np.maximum(best, self._held_rows(self.held(peak, g, kind), first[rows]), out=best)
            if best is not held:
                held[rows] = best
        if self.ties:
            static = static - (self._tie_surplus if starts is None else self._tie_rows(starts))
        out = static + held
        for i, a in enumerate(first):  # a start receiving a storage apart: its view's row
            if int(a) in self.views:
                out[i] = self.views[int(a)]._rows(g, [int(a)])[0]
        return out

    def _held_rows(self, terms: HeldTerms, first: np.ndarray) -> np.ndarray:
        """value[i, e]: what stage [first[i], e) holds under `terms` beyond its static bytes, where e > first[i]
        (elsewhere any finite number: `_rows` adds +inf there). The terms that hold only where a condition
        does are added at those cells alone: an (L + 1)^2 table is a few full passes, not one per term."""
        trained = self.costs.trained
        bytes_ = prefix_sums(terms.per_unit)
        value = bytes_[None, :] - bytes_[first][:, None]
        value += terms.at_start[first][:, None]
        value += terms.at_end[None, :]
        if terms.inner:
            value += inner_rows(terms.inner, first, value.shape[1])
        if terms.gaps:  # (no unit recomputed here: every unit's recomputation has none)
            value -= inner_rows([(j, l, x, -1) for l, j, x in terms.gaps], first, value.shape[1])
        # where the stage holds its last trained unit (no recomputation here but every unit's, under which
        # the weight kind counts no trained_end): a <= trained[e]
        ends = np.flatnonzero(terms.trained_end)
        if len(ends):
            value[:, ends] += np.where(first[:, None] <= trained[ends][None, :], terms.trained_end[ends][None, :], 0.0)
        # where the first unit holds its h: the stage's only one (e = a + 1), or its last trained one (trained[e] = a)
        holds = np.append(terms.first_holds - terms.alone_shared, 0.0)[first]
        rows = np.flatnonzero(holds)
        if len(rows):
            at = {int(a): i for i, a in enumerate(first)}
            cells = {(int(i), int(first[i]) + 1) for i in rows if first[i] + 1 < value.shape[1]}
            cells |= {(at[int(t)], e) for e, t in enumerate(trained) if int(t) in at and holds[at[int(t)]] != 0}
            i, e = np.array(sorted(cells)).reshape(-1, 2).T
            value[i, e] += holds[i]
        return value

    def _tie_rows(self, starts: Optional[List[int]]) -> np.ndarray:
        return range_static_surplus(self.ties, self.tie_static, self.costs.num_units, starts, self.tie_whole,
                                    self.shard)

    @cached_property
    def _tie_surplus(self) -> np.ndarray:
        """The ties' surplus over every range: the same for every stage, so made once."""
        return self._tie_rows(None)
