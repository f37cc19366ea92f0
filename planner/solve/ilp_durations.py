"""The integer program's duration terms (planner.solve.ilp). The step graph's durations are linear in
the split (planner.solve.ilp_split; planner.cost.model, stage g on rank i = the schedule's placement of
g at speed sigma_i):

    F_g = (k^f + sum_l f_l x[l][g]) / sigma_i       B_g = (k^b + sum_l g_l x[l][g] + sum_l f_l rho[l][g]) / sigma_i
    (zero-bubble: BI_g, BW_g the same with gi_l (and k^b), gw_l; the 'weight' memory term with h_l; BW_g of
    g > 0 also walk_g = sum_k omega_k NU_k x[k][g] - sum_a NU_a y[a][g], y[a][g] = e[a][g-1] Omega_g linearised
    exactly (`_walk`): the weight calls' walk of planner.cost.ranges; a stage g > 0 starting at a cut no gradient
    crosses splits as the first: whole_g = sum_k e[k][g-1] over those cuts, and each of BI_g, BW_g and its held
    bytes a variable at least the later kind - M whole_g and the first's kind - M (1 - whole_g))
    A_g = sum_k e[k][g] (lat + act_k / bw_g)        G_g = sum_k e[k][g] (lat + grad_k / bw_g)      (when > 0)
    R_i = sum_{g on i} sum_l ar_l x[l][g] + lat_i w_i,   w_i >= x[l][g] for ar_l > 0 (w_i binary: the rank
          exchanges anything; its rings' latency lat_i under a placement)
    O_i = sum_{g on i} sum_l o_l / sigma_i x[l][g]

less what the tied weights' rows take off (planner.solve.ilp_ties).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import pulp

from planner.cost.model import boundary_links, collective_latency, exchange_latency, rank_speeds, sync_time
from planner.pipeline.schedule import ZERO_BUBBLE_SCHEDULES
from planner.solve.floors import check_deadline
from planner.solve.ilp_ties import TieRows
from planner.solve.ilp_split import MS, variable


class DurationRows(TieRows):
    """Every duration term of the step graph as a variable of the split (`term`)."""

    def _durations(self, deadline: Optional[float]) -> None:
        c, opts, L, S, p = self.costs, self.opts, self.L, self.S, self.p
        speeds, links = rank_speeds(opts), boundary_links(opts)
        redo_all = opts.recompute == "all"
        # a bound (seconds at speed 1) of either split part of any stage, the big-M of a stage's two kinds
        longest = c.later_input + c.later_weight + c.first_input + c.first_call + float(
            (c.g + c.gi + c.gw + 2 * c.f).sum() + (c.omega * c.NU[:-1]).sum()) if self.whole else 0.0
        for g in range(S):
            check_deadline(deadline)
            sigma = speeds[opts.rank_of_stage(g)]
            units = [l for l in range(L) if self.may(l, g)]
            forward = c.call_forward * MS / sigma + pulp.lpSum(c.f[l] * MS / sigma * self.x(l, g) for l in units)
            backward = c.call_backward * MS / sigma + pulp.lpSum(
                (c.g[l] + (c.again[l] if redo_all else 0.0)) * MS / sigma * self.x(l, g) for l in units)
            backward += pulp.lpSum(c.again[l] * MS / sigma * r for (l, gg), r in self.rho.items() if gg == g)
            self.term[("forward", g)] = self._define(f"F_{g}", forward)
            self.term[("backward", g)] = self._define(f"B_{g}", backward)
            if opts.schedule in ZERO_BUBBLE_SCHEDULES:
                # planner.cost.ranges: a later stage's parts; the first stage's input part runs nothing
                # and its weight part is its whole backward (a recomputed forward runs once, there)
                redo = lambda l: c.again[l] if redo_all else 0.0  # noqa: E731  (recomputed in both parts)
                # (so does a later stage starting where no input carries a gradient: whole_g, `_whole_start`)
                later = {"backward_input": (c.gi, c.later_input), "backward_weight": (c.gw, c.later_weight)}
                first = {"backward_input": (0.0 * c.g, c.first_input), "backward_weight": (c.g, c.first_call)}
                whole = self.whole.get(g)
                # the kinds stage g may split as: the first stage only as the first; a later one as a later
                # stage, and as the first where it may start at such a cut (whole_g then says which)
                kinds = [True] if g == 0 else [False] + ([True] if whole is not None else [])
                for name in later:
                    expressions = []
                    for kind in kinds:
                        per_unit, call = (first if kind else later)[name]
                        again = not kind or name == "backward_weight"
                        expr = call * MS / sigma + pulp.lpSum((per_unit[l] + again * redo(l)) * MS / sigma * self.x(l, g)
                                                              for l in units)
                        if again:
                            expr += pulp.lpSum(c.again[l] * MS / sigma * r for (l, gg), r in self.rho.items() if gg == g)
                        if name == "backward_weight" and not kind:
                            expr += self._walk(g, units) * (MS / sigma)
                        expressions.append(expr)
                    if len(expressions) == 1:
                        self.term[(name, g)] = self._define(f"{name}_{g}", expressions[0])
                    else:  # at least the kind whole_g says (the rows bound T from below: it takes that one)
                        most = longest * MS / sigma + 1.0
                        v = variable(self.prob, f"{name}_{g}")
                        self.add(v >= expressions[0] - most * whole, f"{name}_{g}_later")
                        self.add(v >= expressions[1] - most * (1 - whole), f"{name}_{g}_whole")
                        self.term[(name, g)] = v
            if g < S - 1:
                cuts = [k for k in range(1, L) if self.cut_may_end(k, g)]
                for kind, gradient in (("act", False), ("grad", True)):
                    expr = pulp.lpSum(c.message_s(k, links[g], gradient) * MS * self.ends(k, g) for k in cuts
                                      if c.message_s(k, links[g], gradient))
                    self.term[(kind, g)] = self._define(f"{kind}_{g}", expr)
        rest_moves: Optional[Dict[int, bool]] = None  # the same for every rank: made once, where needed
        for i in range(p):
            stages = opts.stages_on(i)
            exchange = sync_time(c.p, c.t, c.fb, opts, self.profile.dtype, self.m, rank=i,
                                 buffer_bytes=c.buf) * MS  # per unit, on rank i
            exchange = exchange + self.m * c.collectives * collective_latency(opts, i) * MS  # ZeRO-3 placed
            moving = [(l, g) for g in stages for l in range(L) if self.may(l, g) and exchange[l] > 0]
            reduce = pulp.lpSum(exchange[l] * self.x(l, g) for l, g in moving)
            per_copy = {tie.name: sync_time(tie.bytes_, tie.bytes_, 0.0, opts, self.profile.dtype, self.m, rank=i) * MS
                        for tie in self.ties}
            reduce -= pulp.lpSum(per_copy[tie.name] * self.tie_exchanged(tie, i) for tie in self.ties)
            reduce += self._kept_whole_exchange(i, per_copy)
            latency = exchange_latency(opts, i) * MS
            if latency > 0 and moving:  # charged only when the rank exchanges anything (w_i)
                w = variable(self.prob, f"exchanges_{i}", binary=True)
                rest_moves = self._rest_moves() if rest_moves is None else rest_moves
                for l, g in moving:
                    if not rest_moves.get(l, True):  # only its ties' copies move: below
                        continue
                    self.add(w >= self.x(l, g), f"exchanges_{i}_{l}_{g}")
                for tie in self.ties:  # a tie not spanning ranks is exchanged in its rank's buckets
                    if (tie.name, i) in self.alone and per_copy[tie.name] > 0:
                        held = self.hold if opts.local_sgd else self.alone  # local SGD: averaged wherever held
                        self.add(w >= held[tie.name, i], f"exchanges_{i}_{tie.name}")
                reduce += latency * w
            step = pulp.lpSum(c.o[l] * MS / speeds[i] * self.x(l, g)
                              for g in stages for l in range(L) if self.may(l, g) and c.o[l])
            step -= pulp.lpSum(tie.step_s * MS / speeds[i] * self.tie_held(tie, i) for tie in self.ties)
            self.term[("reduce", i)] = self._define(f"R_{i}", reduce)
            self.term[("step", i)] = self._define(f"O_{i}", step)


    def _walk(self, g: int, units: List[int]):
        """walk(a, e) of stage g > 0 (planner.cost.ranges), seconds: sum_k omega_k NU[k] x[k][g] - NU[a] Omega_g
        for the unit a it starts at, Omega_g = sum_l omega_l x[l][g]; the product of `cut a ends stage g - 1`
        (s, binary) and Omega_g is y[a][g], exact by y <= Omega_g, y <= Omax s, y >= Omega_g - Omax (1 - s)."""
        c = self.costs
        if not c.nu.any():
            return 0.0
        calls = pulp.lpSum(c.omega[l] * self.x(l, g) for l in units if c.omega[l])
        most = float(sum(c.omega[l] for l in units))
        walk = pulp.lpSum(c.omega[k] * c.NU[k] * self.x(k, g) for k in units if c.omega[k] * c.NU[k])
        for a in range(1, self.L):
            if c.NU[a] <= 0 or not self.cut_may_end(a, g - 1):
                continue
            starts, y = self.ends(a, g - 1), variable(self.prob, f"walk_start_{a}_{g}")
            self.add(y <= calls, f"walk_calls_{a}_{g}")
            self.add(y <= most * starts, f"walk_starts_{a}_{g}")
            self.add(y >= calls - most * (1 - starts), f"walk_exact_{a}_{g}")
            walk -= c.NU[a] * y
        return walk
