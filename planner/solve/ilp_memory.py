"""The integer program's memory rows (planner.solve.ilp), the terms of planner.cost.stage_memory: for
rank i and each of its list's peak vectors P (planner.pipeline.stepgraph.held_peaks),

    sum_{g on i} sum_l x[l][g] P_l beta  +  sum_{g on i} [ P_live,g (sum_l x[l][g] s_l - sum_l rho[l][g] (s_l - in_l))
        + P_inbox,g sum_k e[k][g-1] act_k + P_gradbox,g sum_k e[k][g] grad_k
        + P_sent_act,g sum_k e[k][g] act_k + P_sent_grad,g sum_k e[k][g-1] grad_k ]  <=  cap_i

less a tied weight's copies beyond the one a rank holds (planner.solve.ilp_ties). Where stage g may start at a
cut a at which it receives views of one storage apart, its terms there differ (planner.cost.received): the row
adds that difference D_a times e[a][g-1] (each of its terms a product with the start; only the terms a stage
starting at a holds: its units from a on, its start at a).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import pulp

from planner.cost.stage_memory import StageMemory
from planner.solve.floors import check_deadline
from planner.solve.ilp_split import MIB, variable
from planner.solve.ilp_ties import TieRows


class MemoryRows(TieRows):
    """A row per rank and peak of its list: its held bytes within its cap."""

    def _product(self, name: str, ones, zeros=(), exact: bool = True):
        """v = prod(ones) prod(1 - zeros) of binaries (or 0/1 constants), made once per name: v >= 0,
        v >= sum(ones) + sum(1 - zeros) - (n - 1), and, `exact`, v <= each factor (a term whose
        coefficient may be negative needs both; one the memory rows never want larger only the first)."""
        factors = list(ones) + [1 - z for z in zeros]
        if name not in self._products:
            v = self._products[name] = variable(self.prob, name)
            self.add(v >= pulp.lpSum(factors) - (len(factors) - 1), f"{name}_all")
        v = self._products[name]
        if exact and name not in self._exact:  # (made so before for a term that wants it no larger)
            self._exact.add(name)
            for n, factor in enumerate(factors):
                self.add(v <= factor, f"{name}_{n}")
        return v

    def _end(self, e: int, g: int):
        """1 where stage g ends at cut e (the last stage at L)."""
        return self.ends(e, g) if e < self.L else 1

    def _may_end(self, e: int, g: int) -> bool:
        """Whether stage g may end at cut e (the last stage at L alone)."""
        return self.cut_may_end(e, g) if e < self.L else g == self.S - 1

    def _trained_end(self, e: int, g: int):
        """1 where stage g ends at cut e, holds unit t = trained[e] (its last unit with a trained
        parameter) and recomputes none of units t .. e - 1: its weight kind's `trained_end` applies."""
        t = int(self.costs.trained[e])
        redo = [self.rho[l, g] for l in range(t, e) if (l, g) in self.rho]
        return self._product(f"trained_end_{e}_{g}", [self._end(e, g), self.x(t, g)], redo)

    def _first_holds(self, a: int, g: int):
        """1 where stage g > 0 starts at unit a, which holds its h and is not recomputed (`first_holds`)."""
        return self._holding(a, g, "first_holds", self.ends(a, g - 1)) if self.cut_may_end(a, g - 1) else 0

    def _holds_after_recomputed(self, l: int, g: int, start: Optional[int] = None):
        """1 where unit l holds its h in stage g, is not recomputed and unit l - 1 is (`alone_shared`); with
        `start`, and stage g starts at that cut."""
        if start is None:
            return self._holding(l, g, "after_recomputed", self.rho[l - 1, g])
        factor = self._product(f"after_recomputed_{l}_{g}_starts{start}", [self.ends(start, g - 1), self.rho[l - 1, g]])
        return self._holding(l, g, f"after_recomputed_from{start}", factor)

    def _holding(self, l: int, g: int, name: str, factor):
        """`factor` times 1 where unit l holds its h in stage g and is not recomputed: the stage ends after
        it, or it is the last trained unit of a stage ending in frozen units at e (`_trained_end`; at
        most one of these ways is 1)."""
        terms = []
        if self._may_end(l + 1, g):
            redo = [self.rho[l, g]] if (l, g) in self.rho else []
            terms.append(self._product(f"{name}_{l}_{g}", [factor, self._end(l + 1, g)], redo))
        for e in range(l + 2, self.L + 1):
            if int(self.costs.trained[e]) == l and self._may_end(e, g):
                terms.append(self._product(f"{name}_{l}_{g}_{e}", [factor, self._trained_end(e, g)]))
        return pulp.lpSum(terms)

    def _memory(self, deadline: Optional[float]) -> None:
        opts, L = self.opts, self.L
        memory = StageMemory(self.profile, self.b, opts, opts.recompute == "all")
        if all(cap is None for cap in memory.caps):
            return
        beta_w, beta_t = memory.factors
        for i in range(self.p):
            check_deadline(deadline)
            if memory.caps[i] is None:
                continue
            static = pulp.lpSum(memory.static_per_unit[l] / MIB * self.x(l, g)
                                for g in opts.stages_on(i) for l in range(L) if self.may(l, g))
            static -= pulp.lpSum(copy / MIB * self.tie_held(tie, i) for tie, copy in zip(memory.ties, memory.tie_static))
            static += pulp.lpSum((whole - copy) / MIB * self.tie_whole(tie, i, memory.shard)
                                 for tie, copy, whole in zip(memory.ties, memory.tie_static, memory.tie_whole)
                                 if whole != copy)
            for n, peak in enumerate(memory.peaks[i]):
                held = 0
                for g in opts.stages_on(i):
                    whole = self.whole.get(g)
                    if whole is None:
                        held += self._stage_held(memory, peak, g, None)[0]
                        continue
                    # either kind of a later stage (planner.cost.stage_memory's `whole`): at least the one
                    # whole_g says, the row keeps it no larger
                    kinds, bounds = zip(*(self._stage_held(memory, peak, g, kind) for kind in (False, True)))
                    most = sum(bounds) + 1.0
                    h = variable(self.prob, f"held_{i}_{n}_{g}", low=-most)
                    self.add(h >= kinds[0] - most * whole, f"held_{i}_{n}_{g}_later")
                    self.add(h >= kinds[1] - most * (1 - whole), f"held_{i}_{n}_{g}_whole")
                    held += h
                cap = memory.caps[i]
                cap = math.floor(cap) if beta_w.is_integer() and beta_t.is_integer() else cap
                self.add(static + held <= cap / MIB, f"memory_{i}_{n}")

    def _stage_held(self, memory: StageMemory, peak, g: int, whole):
        """(stage g's held bytes (MiB) under `peak`, a bound of their size over every split): its terms, and where
        it starts at a cut a stage receives a storage apart at, the difference of that start's terms
        (planner.cost.received), times [stage g starts at a]."""
        terms = memory.held(peak, g, whole)
        held, most = self._held(terms, g), _most(terms)
        for a, view in memory.views.items():
            if g > 0 and self.cut_may_end(a, g - 1):
                delta = _difference(view.held(peak, g, whole), terms, a)
                held += self._held(delta, g, start=a)
                most += _most(delta)
        return held, most

    def _held(self, terms, g: int, start: Optional[int] = None):
        """Stage g's held bytes (MiB) under its terms (StageMemory.held's), linear in the split; with `start`,
        each term times [stage g starts at cut `start`] (only the terms such a stage may hold)."""
        L = self.L
        begins = None if start is None else self.ends(start, g - 1)

        def times(coef: float, name: str, ones, zeros=(), exact: bool = True):
            """coef (bytes) times prod(ones) prod(1 - zeros), in MiB; with `start`, times [it starts there]."""
            if start is None:
                if len(ones) == 1 and not zeros:
                    return coef / MIB * ones[0]
                return coef / MIB * self._product(name, ones, zeros, exact=exact)
            return coef / MIB * self._product(f"{name}_from{start}", [begins, *ones], zeros)  # (either sign)

        def rho(l: int):
            return [self.rho[l, g]] if (l, g) in self.rho else []

        held = 0
        held += pulp.lpSum(times(terms.per_unit[l], f"unit_{l}_{g}", [self.x(l, g)]) for l in range(L)
                           if terms.per_unit[l] and self.may(l, g))
        held -= pulp.lpSum(times(terms.recompute_saves[l], f"recomputed_{l}_{g}", [r])
                           for (l, gg), r in self.rho.items() if gg == g and terms.recompute_saves[l])
        held += pulp.lpSum(times(terms.shared_lost[k], f"shared_lost_{k}_{g}", [self.rho[k - 1, g], self.x(k, g)],
                                 exact=terms.shared_lost[k] < 0)
                           for k in range(1, L) if terms.shared_lost[k] and (k - 1, g) in self.rho)
        held -= pulp.lpSum(times(terms.pair[k], f"both_recomputed_{k}_{g}", [self.rho[k - 1, g], self.rho[k, g]])
                           for k in range(1, L) if terms.pair[k] and (k - 1, g) in self.rho and (k, g) in self.rho)
        if g > 0:  # the cut the stage starts at ends stage g - 1
            held += pulp.lpSum(times(terms.first_recomputed[l], f"first_recomputed_{l}_{g}",
                                     [self.rho[l, g], self.ends(l, g - 1)])
                               for l in range(1, L) if terms.first_recomputed[l] and (l, g) in self.rho
                               and self.cut_may_end(l, g - 1))
            held += pulp.lpSum(terms.at_start[k] / MIB * self.ends(k, g - 1) for k in range(1, L)
                               if terms.at_start[k] and self.cut_may_end(k, g - 1))  # (a start's: at k = start only)
        else:  # the first stage starts at unit 0
            held += terms.at_start[0] / MIB
        held += pulp.lpSum(times(terms.at_end[k], f"end_{k}_{g}", [self.ends(k, g)]) for k in range(1, L)
                           if terms.at_end[k] and self.cut_may_end(k, g))
        if g == self.S - 1:  # the last stage ends at unit L
            held += terms.at_end[L] / MIB if start is None else terms.at_end[L] / MIB * begins
        held -= pulp.lpSum(times(terms.last_unit[l + 1], f"last_recomputed_{l}_{g}", [r, self._end(l + 1, g)])
                           for (l, gg), r in self.rho.items() if gg == g and terms.last_unit[l + 1])
        if g > 0:  # a first unit holding its h shares nothing counted with a unit before it (a start's: in itself)
            first_alone = terms.first_holds - terms.alone_shared
            held += pulp.lpSum(first_alone[a] / MIB * self._first_holds(a, g) for a in range(1, L)
                               if first_alone[a] and self.may(a, g))
        held -= pulp.lpSum(terms.after_recomputed[l] / MIB * self._holds_after_recomputed(l, g, start)
                           for l in range(1, L) if terms.after_recomputed[l] and (l - 1, g) in self.rho)
        # a value unit k reads computed in the stage from unit t on (planner.cost.inner_weight): both in it, and
        # where h >= 0, h not recomputed
        held += pulp.lpSum(times(x, f"inner_{k}_{t}_{h}_{g}", [self.x(k, g), self.x(t, g)], rho(h), exact=x < 0)
                           for k, t, x, h in terms.inner if x and self.may(k, g) and self.may(t, g))
        # a storage units l and j both save, none between them (planner.cost.ranges' gap): both in the stage, none of
        # l .. j recomputed
        held -= pulp.lpSum(times(x, f"gap_{l}_{j}_{g}", [self.x(l, g), self.x(j, g)],
                                 [r for m in range(l, j + 1) for r in rho(m)])
                           for l, j, x in terms.gaps if x and self.may(l, g) and self.may(j, g))
        held += pulp.lpSum(times(terms.trained_end[e], f"trained_end_{e}_{g}",
                                 [self._end(e, g), self.x(int(self.costs.trained[e]), g)],
                                 [r for l in range(int(self.costs.trained[e]), e) for r in rho(l)])
                           for e in range(1, L + 1)
                           if terms.trained_end[e] and self.may(int(self.costs.trained[e]), g) and self._may_end(e, g))
        return held


def _difference(view, base, a: int):
    """HeldTerms: `view`'s terms less `base`'s, those a stage starting at cut a may hold (the rest 0): a start's
    difference (planner.cost.received; the terms of its units before a are the profile's)."""
    def part(name: str, low: int, only: bool = False):
        out = getattr(view, name) - getattr(base, name)
        keep = np.arange(len(out)) == a if only else np.arange(len(out)) >= low
        return np.where(keep, out, 0.0)

    gaps: dict = {}
    for table, sign in ((view.gaps, 1.0), (base.gaps, -1.0)):
        for l, j, x in table:
            if l >= a:
                gaps[l, j] = gaps.get((l, j), 0.0) + sign * x
    return dataclasses.replace(
        base, per_unit=part("per_unit", a), at_start=part("at_start", a, True), at_end=part("at_end", a + 1),
        recompute_saves=part("recompute_saves", a), shared_lost=part("shared_lost", a + 1),
        last_unit=part("last_unit", a + 1), first_recomputed=part("first_recomputed", a, True),
        trained_end=part("trained_end", a + 1), first_holds=part("first_holds", a, True),
        alone_shared=part("alone_shared", a, True), after_recomputed=part("after_recomputed", a + 1),
        pair=part("pair", a + 1), inner=(), gaps=tuple((l, j, x) for (l, j), x in gaps.items() if x))


def _most(terms) -> float:
    """A bound (MiB) of |a stage's held bytes| under these terms (StageMemory.held's) over every split."""
    return float(sum(np.abs(t).sum() for t in (terms.per_unit, terms.recompute_saves, terms.shared_lost,
                                                 terms.at_start, terms.at_end, terms.last_unit,
                                                 terms.first_recomputed, terms.trained_end,
                                                 terms.first_holds, terms.alone_shared, terms.after_recomputed,
                                                 terms.pair))
                 + sum(abs(x) for _, _, x, _ in terms.inner) + sum(abs(x) for _, _, x in terms.gaps)) / MIB

