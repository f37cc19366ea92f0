"""The integer program of one scenario (schedule, p, d, v, micro-batch size b) over the exact model.

Split (staircase over S = p v stages): z[l][g] = 1 iff unit l is in a stage <= g, with

    z[l][S-1] = 1;  z[l][g] >= z[l+1][g] (contiguity);  z[l][g] <= z[l][g+1];  z[l][g] <= z[l+1][g+1]
    x[l][g] = z[l][g] - z[l][g-1]   (unit l in stage g)      e[k][g] = z[k-1][g] - z[k][g]   (cut k ends g)

and variables outside each unit's stage range (planner.solve.reach) fixed. Recomputation under
'auto' with a cap: rho[l][g] <= x[l][g]. The step graph's durations are linear in these
(planner.cost.model, stage g on rank i = the schedule's placement of g at speed sigma_i):

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
    tau_t = sum_n y[t][n] tie(bytes_t, n d),   sum_n y[t][n] = 1,   sum_n n y[t][n] = sum_i h[t][i],
    h[t][i] >= x[u][g] for each use u of tied weight t and stage g on rank i,  h[t][i] <= k[t][i]
    k[t][i] = sum_{u, g on i} x[u][g] (t's uses on rank i),   q[t][i] = h[t][i] y[t][1] (i holds t alone)
    R_i -= sum_t ar_t (k[t][i] - q[t][i]),  O_i -= sum_t o_t / sigma_i (k[t][i] - h[t][i]), static bytes of
    rank i -= sum_t (beta^w + beta^t) c_t (k[t][i] - h[t][i]): one copy c_t of a tied weight per rank
    (planner.cost.ties; beta^w c_t and no tau_t, R_i, O_i terms for a frozen one; under local SGD the
    exchange takes off k - h); + (W_t - C_t) whole[t][i] where rank i keeps its copy whole under ZeRO
    (W_t, C_t: a copy's static bytes unsharded and sharded; `tie_whole`); w_i >= q[t][i] for the ties, and
    not for a unit whose exchange is its ties' alone. Under ZeRO-3 (d > 1) with two[t][i] = [k[t][i] >= 2]
    (binary: (n_t - 1) two >= k - h >= two): R_i += (N_t - ar_t) a[t][i], a = q two (a trainable tie
    on rank i alone, kept whole: all-reduced once a step, N_t, not sharded), and R_i -= two[t][i]
    sum_{u, g on i} gz_u x[u][g] for a frozen one (its gathers gz_u, none when kept whole), each
    product linearised exactly (`_kept_whole_exchange`)

The step time is the longest path of the lists' graph, the largest of its paths' sums; each known
path k (a critical-path form: counts c_k of duration terms) gives a row

    T >= sum_terms c_k(term) duration(term)                         minimise T + step_overhead

which holds for every split (the path exists whatever the durations). A path that crosses from
rank j to rank i through tied weight t's all-reduce exists only when both hold a use of t:
T >= form - M (2 - h[t][j] - h[t][i]). Memory (the terms of planner.cost.stage_memory): for rank i and
each of its list's peak vectors P (planner.pipeline.stepgraph.held_peaks),

    sum_{g on i} sum_l x[l][g] P_l beta  +  sum_{g on i} [ P_live,g (sum_l x[l][g] s_l - sum_l rho[l][g] (s_l - in_l))
        + P_inbox,g sum_k e[k][g-1] act_k + P_gradbox,g sum_k e[k][g] grad_k
        + P_sent_act,g sum_k e[k][g] act_k + P_sent_grad,g sum_k e[k][g-1] grad_k ]  <=  cap_i

With only some paths known, T is a lower bound of the step time of the split the program picks;
planner.solve.exact adds the picked split's own critical path until the two agree.
Times are in milliseconds and memory in MiB inside the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pulp

from planner.cost.model import (boundary_links, collective_latency, exchange_latency, num_micro_batches, rank_caps,
                                rank_speeds, reduce_time, shared_parameters, sync_time, tie_time, whole_reduce_time)
from planner.cost.options import CostOptions
from planner.cost.result import PathForm
from planner.cost.ranges import range_costs
from planner.cost.stage_memory import StageMemory
from planner.cost.ties import tie_copies, tied_weights
from planner.pipeline.schedule import ZERO_BUBBLE_SCHEDULES
from planner.profile.profile import Profile
from planner.solve.backends import _run_cbc, _run_highs
from planner.solve.floors import check_deadline

MS = 1e3  # seconds -> milliseconds
MIB = float(2 ** 20)  # bytes -> MiB


@dataclass
class ProgramResult:
    boundaries: Optional[List[int]]
    recompute: List[int]
    value_s: Optional[float]  # T at the program's solution (a lower bound of that split's step)
    bound_s: float  # the solver's proven lower bound over every split (seconds), -inf if none
    optimal: bool  # the program was solved to optimality (or proven to have nothing below the cutoff)
    below_cutoff: bool  # a solution under the cutoff exists
    ran: bool = True  # False: the solver crashed (no answer at all)


class _NoSplit(Exception):
    """Fixed variables contradict each other: no split is left."""


def _var(prob: pulp.LpProblem, name: str, binary: bool = False, low: float = 0.0) -> pulp.LpVariable:
    high, cat = (1, pulp.LpInteger) if binary else (None, pulp.LpContinuous)
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3: variables attached to their problem
        return prob.add_variable(name, low, high, cat=cat)
    return pulp.LpVariable(name, low, high, cat=cat)


class Program:
    """The program for one scenario; rows for path forms are added before each solve."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, low: Sequence[int], high: Sequence[int],
                 deadline: Optional[float] = None):
        """OutOfTime past `deadline` (time.perf_counter(); checked per stage and device): at a thousand
        units the rows take seconds to build."""
        self.profile, self.b, self.opts = profile, b, opts
        self.costs = range_costs(profile, b, opts.optimizer)
        L, S, p = profile.num_units, opts.num_stages, opts.pipeline_ranks
        self.L, self.S, self.p = L, S, p
        self.m = num_micro_batches(opts, b)
        self.low, self.high = list(low), list(high)
        self.prob = pulp.LpProblem("pipeline_plan", pulp.LpMinimize)
        self.z = [[self._z(l, g) for g in range(S)] for l in range(L)]
        self._staircase()
        self._recompute_vars()
        self.term: Dict[Tuple, object] = {("message",): opts.message_s * MS}  # every duration term's variable
        # whole_g of each later stage (`_whole_start`), read by its durations and by every memory row
        self.whole = {g: self._whole_start(g) for g in range(1, S)} if opts.schedule in ZERO_BUBBLE_SCHEDULES else {}
        self._ties()
        self._durations(deadline)
        self._memory(deadline)
        self.T = _var(self.prob, "T")
        self.prob += self.T + opts.step_overhead_s * MS
        self.forms: List[PathForm] = []

    # --- split ----------------------------------------------------------------------------------
    def _z(self, l: int, g: int):
        if g >= self.high[l] or g == self.S - 1:
            return 1
        if g < self.low[l]:
            return 0
        return _var(self.prob, f"z_{l}_{g}", binary=True)

    def add(self, constraint, name: str) -> None:
        if isinstance(constraint, pulp.LpConstraint) and len(constraint) > 0:
            self.prob.addConstraint(constraint, name)
        elif (isinstance(constraint, bool) and not constraint) or \
                (isinstance(constraint, pulp.LpConstraint) and not constraint.valid(1e-9)):
            raise _NoSplit(name)

    def _staircase(self) -> None:
        z, L, S = self.z, self.L, self.S
        for l in range(L):
            for g in range(S):
                if l + 1 < L:
                    self.add(z[l][g] >= z[l + 1][g], f"contiguous_{l}_{g}")
                if g + 1 < S:
                    self.add(z[l][g] <= z[l][g + 1], f"prefix_{l}_{g}")
                if l + 1 < L and g + 1 < S:
                    self.add(z[l][g] <= z[l + 1][g + 1], f"nonempty_{l}_{g}")

    def x(self, l: int, g: int):
        return self.z[l][g] - (self.z[l][g - 1] if g > 0 else 0)

    def may(self, l: int, g: int) -> bool:
        return self.low[l] <= g <= self.high[l]

    def ends(self, k: int, g: int):
        """1 iff cut k ends stage g (unit k - 1 in g, unit k in g + 1)."""
        return self.z[k - 1][g] - self.z[k][g]

    def cut_may_end(self, k: int, g: int) -> bool:
        return self.may(k - 1, g) and self.may(k, g + 1)

    def _recompute_vars(self) -> None:
        c, opts = self.costs, self.opts
        self.rho: Dict[Tuple[int, int], pulp.LpVariable] = {}
        self._lost: Dict[Tuple[int, int], pulp.LpVariable] = {}  # _sharing_lost's variables
        self._last: Dict[Tuple[int, int], pulp.LpVariable] = {}  # _last_recomputed's variables
        if opts.recompute != "auto" or all(cap is None for cap in rank_caps(opts, self.profile)):
            return
        # a unit saving no more than its inputs frees nothing by recomputing in a stage's live kind,
        # but may in the zero-bubble weight kind (h_l over its inputs, a later stage's last unit:
        # planner.cost.stage_memory), where the program weighs it
        zero_bubble = opts.schedule in ZERO_BUBBLE_SCHEDULES
        for l in range(self.L):
            if c.s[l] > c.inputs[l] or zero_bubble:
                for g in range(self.low[l], self.high[l] + 1):
                    self.rho[l, g] = _var(self.prob, f"r_{l}_{g}", binary=True)
                    self.add(self.rho[l, g] <= self.x(l, g), f"recompute_in_stage_{l}_{g}")

    # --- durations (ms) -------------------------------------------------------------------------
    def _define(self, name: str, expression) -> pulp.LpVariable:
        v = _var(self.prob, name)
        self.add(v == expression, f"define_{name}")
        return v

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
                (c.g[l] + (c.f[l] if redo_all else 0.0)) * MS / sigma * self.x(l, g) for l in units)
            backward += pulp.lpSum(c.f[l] * MS / sigma * r for (l, gg), r in self.rho.items() if gg == g)
            self.term[("forward", g)] = self._define(f"F_{g}", forward)
            self.term[("backward", g)] = self._define(f"B_{g}", backward)
            if opts.schedule in ZERO_BUBBLE_SCHEDULES:
                # planner.cost.ranges: a later stage's parts; the first stage's input part runs nothing
                # and its weight part is its whole backward (a recomputed forward runs once, there)
                redo = lambda l: c.f[l] if redo_all else 0.0  # noqa: E731  (recomputed in both parts)
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
                            expr += pulp.lpSum(c.f[l] * MS / sigma * r for (l, gg), r in self.rho.items() if gg == g)
                        if name == "backward_weight" and not kind:
                            expr += self._walk(g, units) * (MS / sigma)
                        expressions.append(expr)
                    if len(expressions) == 1:
                        self.term[(name, g)] = self._define(f"{name}_{g}", expressions[0])
                    else:  # at least the kind whole_g says (the rows bound T from below: it takes that one)
                        most = longest * MS / sigma + 1.0
                        v = _var(self.prob, f"{name}_{g}")
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
                w = _var(self.prob, f"exchanges_{i}", binary=True)
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

    def _whole_start(self, g: int):
        """1 iff stage g > 0 starts at a cut no value with a gradient crosses (planner.cost.ranges' `whole`:
        its split backward is the first stage's), a sum of e[k][g - 1]; None where no such cut may start it."""
        cuts = [k for k in range(1, self.L) if self.costs.whole[k] and self.cut_may_end(k, g - 1)]
        return pulp.lpSum(self.ends(k, g - 1) for k in cuts) if cuts else None

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
            starts, y = self.ends(a, g - 1), _var(self.prob, f"walk_start_{a}_{g}")
            self.add(y <= calls, f"walk_calls_{a}_{g}")
            self.add(y <= most * starts, f"walk_starts_{a}_{g}")
            self.add(y >= calls - most * (1 - starts), f"walk_exact_{a}_{g}")
            walk -= c.NU[a] * y
        return walk

    def _ties(self) -> None:
        """h[t][i]: tied weight t has a use on rank i (k[t][i] of them); tau_t its all-reduce
        (one-hot y over holder counts); q[t][i] = h[t][i] y[t][1]: rank i is t's only holder."""
        opts, S, c = self.opts, self.S, self.costs
        self.hold: Dict[Tuple[str, int], object] = {}
        self.uses: Dict[Tuple[str, int], object] = {}
        self.alone: Dict[Tuple[str, int], object] = {}
        weights = tied_weights(self.profile)
        self.copies = tie_copies(weights, c)
        self.ties = [tie for tie in self.copies if tie.trainable]  # exchanged and stepped: trainable ones
        self.twice: Dict[Tuple[str, int], object] = {}  # [k[t][i] >= 2] under `parameters`
        for name, uses, size, trainable in weights:  # held once per rank: frozen ones too
            ranks = sorted({opts.rank_of_stage(g) for u in uses for g in range(S) if self.may(u, g)})
            for i in ranks:
                h = _var(self.prob, f"hold_{name}_{i}")
                self.add(h <= 1, f"hold_cap_{name}_{i}")
                k = pulp.lpSum(self.x(u, g) for u in uses for g in opts.stages_on(i) if self.may(u, g))
                for u in uses:
                    for g in opts.stages_on(i):
                        if self.may(u, g):
                            self.add(h >= self.x(u, g), f"hold_{name}_{i}_{u}_{g}")
                self.add(h <= k, f"hold_only_{name}_{i}")  # with h >= each use: h = [k >= 1]
                self.hold[name, i], self.uses[name, i] = h, k
                if opts.shard == "parameters" and len(uses) >= 2:  # two = [k - h >= 1] = [k >= 2]
                    two = _var(self.prob, f"twice_{name}_{i}", binary=True)
                    self.add((len(uses) - 1) * two >= k - h, f"twice_{name}_{i}")
                    self.add(two <= k - h, f"twice_only_{name}_{i}")
                    self.twice[name, i] = two
            if not trainable:  # no gradient: no all-reduce
                continue
            counts = range(1, min(len(uses), len(ranks)) + 1)
            y = {n: _var(self.prob, f"holders_{name}_{n}", binary=True) for n in counts}
            self.add(pulp.lpSum(y.values()) == 1, f"holders_one_{name}")
            self.add(pulp.lpSum(n * v for n, v in y.items()) == pulp.lpSum(self.hold[name, i] for i in ranks),
                     f"holders_count_{name}")
            for i in ranks:
                q = _var(self.prob, f"alone_{name}_{i}")
                self.add(q <= self.hold[name, i], f"alone_holds_{name}_{i}")
                self.add(q <= y[1], f"alone_one_{name}_{i}")
                self.add(q >= self.hold[name, i] + y[1] - 1, f"alone_both_{name}_{i}")
                self.alone[name, i] = q
            self.term[("tie", name)] = self._define(
                f"tie_{name}", pulp.lpSum(tie_time(size, n * opts.tie_replicas, opts) * MS * v for n, v in y.items()))

    def _kept_whole_exchange(self, i: int, per_copy: Dict[str, float]):
        """What ZeRO-3 keeping a tie whole on rank i changes in its exchange (planner.cost.ties), in ms:
        a trainable tie on rank i alone with two uses there (a = q [k >= 2]) is all-reduced whole
        once a step instead of sharded, N - Z per copy; a frozen one with two uses there (twice) is
        gathered for none of them: each use's gathers come off, twice * sum_u Z_u x_u (`frozen_whole`)."""
        opts, dtype, out = self.opts, self.profile.dtype, 0
        if opts.shard != "parameters" or opts.local_sgd or opts.data_parallel <= 1:
            return out
        for tie in self.copies:
            if (tie.name, i) not in self.twice:
                continue
            two = self.twice[tie.name, i]
            if tie.trainable:
                whole = whole_reduce_time(tie.bytes_, opts, dtype, i) * MS - per_copy[tie.name]
                a = _var(self.prob, f"alone_twice_{tie.name}_{i}")
                q = self.alone[tie.name, i]
                self.add(a <= q, f"alone_twice_q_{tie.name}_{i}")
                self.add(a <= two, f"alone_twice_two_{tie.name}_{i}")
                self.add(a >= q + two - 1, f"alone_twice_both_{tie.name}_{i}")
                out += whole * a
                continue
            gathers = [(sync_time(tie.bytes_, 0.0, again, opts, dtype, self.m, rank=i) * MS, u)
                       for u, again in zip(tie.uses, tie.regathered)]
            here = pulp.lpSum(z * self.x(u, g) for z, u in gathers for g in opts.stages_on(i) if self.may(u, g) and z)
            most = sum(z for z, _ in gathers)
            if most <= 0:
                continue
            saved = _var(self.prob, f"frozen_whole_{tie.name}_{i}")  # = twice * here, exactly
            self.add(saved <= here, f"frozen_whole_here_{tie.name}_{i}")
            self.add(saved <= most * two, f"frozen_whole_twice_{tie.name}_{i}")
            self.add(saved >= here - most * (1 - two), f"frozen_whole_both_{tie.name}_{i}")
            out -= saved
        return out

    def _rest_moves(self) -> Dict[int, bool]:
        """Per unit using a tie: whether anything but its ties' copies moves in its exchange (what
        the placement's latency rows ask of a tie's units)."""
        c, out = self.costs, {}
        for l in {u for tie in self.ties for u in tie.uses}:
            own = sum(tie.bytes_ for tie in self.ties if l in tie.uses)
            out[l] = sync_time(c.p[l] - own, c.t[l] - own, c.fb[l], self.opts, self.profile.dtype, self.m,
                               buffer_bytes=c.buf[l]) > 0
        return out

    def tie_held(self, tie, i: int):
        """Copies of `tie` the per-unit sums of rank i count beyond the one it holds: k - h."""
        if (tie.name, i) not in self.hold:
            return 0
        return self.uses[tie.name, i] - self.hold[tie.name, i]

    def tie_exchanged(self, tie, i: int):
        """Copies of `tie` rank i does not exchange in its buckets: k - q (all k when it spans ranks);
        under local SGD k - h (the averaging covers the copy it holds)."""
        if (tie.name, i) not in self.hold:
            return 0
        if self.opts.local_sgd:
            return self.tie_held(tie, i)
        return self.uses[tie.name, i] - self.alone[tie.name, i]

    def tie_whole(self, tie, i: int, shard: str):
        """1 where rank i keeps its copy of `tie` whole (planner.cost.ties.kept_whole): under `gradients`
        h - q (held, spanning ranks); under `parameters` at least that (a trainable tie) and at least
        [k >= 2] (`twice`, a binary the uses force), which the memory rows never want larger."""
        if (tie.name, i) not in self.hold or shard not in ("gradients", "parameters"):
            return 0
        spans = self.hold[tie.name, i] - self.alone[tie.name, i] if tie.trainable else 0
        if shard == "gradients":
            return spans
        whole = _var(self.prob, f"whole_{tie.name}_{i}")
        if tie.trainable:
            self.add(whole >= spans, f"whole_spans_{tie.name}_{i}")
        if (tie.name, i) in self.twice:
            self.add(whole >= self.twice[tie.name, i], f"whole_twice_{tie.name}_{i}")
        return whole

    # --- memory ---------------------------------------------------------------------------------
    def _sharing_lost(self, k: int, g: int):
        """u_kg >= 0, 1 where units k - 1 and k are both in stage g and unit k - 1 is recomputed: what
        both saved is then held twice (planner.cost.stage_memory's `shared_lost`), so
        u_kg >= rho_(k-1)g + x_kg - 1 (the memory rows never want it larger)."""
        if (k, g) not in self._lost:
            u = self._lost[k, g] = _var(self.prob, f"shared_lost_{k}_{g}")
            self.add(u >= self.rho[k - 1, g] + self.x(k, g) - 1, f"shared_lost_{k}_{g}")
        return self._lost[k, g]

    def _last_recomputed(self, l: int, g: int):
        """v_lg, 1 where unit l is stage g's last unit and recomputed (rho_lg and stage g ends at cut
        l + 1): its weight-kind correction (planner.cost.stage_memory's `last_unit`) then does not
        apply. Bounded both ways, as its coefficient may have either sign."""
        if (l, g) not in self._last:
            v = self._last[l, g] = _var(self.prob, f"last_recomputed_{l}_{g}")
            rho = self.rho[l, g]
            self.add(v <= rho, f"last_recomputed_{l}_{g}_rho")
            if l + 1 < self.L:
                ends = self.ends(l + 1, g)
                self.add(v <= ends, f"last_recomputed_{l}_{g}_ends")
                self.add(v >= rho + ends - 1, f"last_recomputed_{l}_{g}_both")
            else:  # unit L - 1 ends the last stage
                self.add(v >= rho, f"last_recomputed_{l}_{g}_both")
        return self._last[l, g]

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
                        held += self._held(memory.held(peak, g), g)
                        continue
                    # either kind of a later stage (planner.cost.stage_memory's `whole`): at least the one
                    # whole_g says, the row keeps it no larger
                    terms = [memory.held(peak, g, kind) for kind in (False, True)]
                    kinds = [self._held(t, g) for t in terms]
                    most = sum(_most(t) for t in terms) + 1.0
                    h = _var(self.prob, f"held_{i}_{n}_{g}", low=-most)
                    self.add(h >= kinds[0] - most * whole, f"held_{i}_{n}_{g}_later")
                    self.add(h >= kinds[1] - most * (1 - whole), f"held_{i}_{n}_{g}_whole")
                    held += h
                cap = memory.caps[i]
                cap = math.floor(cap) if beta_w.is_integer() and beta_t.is_integer() else cap
                self.add(static + held <= cap / MIB, f"memory_{i}_{n}")

    def _held(self, terms, g: int):
        """Stage g's held bytes (MiB) under its terms (StageMemory.held's), linear in the split."""
        L = self.L
        held = 0
        held += pulp.lpSum(terms.per_unit[l] / MIB * self.x(l, g) for l in range(L)
                           if terms.per_unit[l] and self.may(l, g))
        held -= pulp.lpSum(terms.recompute_saves[l] / MIB * r
                           for (l, gg), r in self.rho.items() if gg == g and terms.recompute_saves[l])
        held += pulp.lpSum(terms.shared_lost[k] / MIB * self._sharing_lost(k, g) for k in range(1, L)
                           if terms.shared_lost[k] and (k - 1, g) in self.rho)
        if g > 0:  # the cut the stage starts at ends stage g - 1
            held += pulp.lpSum(terms.at_start[k] / MIB * self.ends(k, g - 1) for k in range(1, L)
                               if terms.at_start[k] and self.cut_may_end(k, g - 1))
        else:  # the first stage starts at unit 0
            held += terms.at_start[0] / MIB
        held += pulp.lpSum(terms.at_end[k] / MIB * self.ends(k, g) for k in range(1, L)
                           if terms.at_end[k] and self.cut_may_end(k, g))
        if g == self.S - 1:  # the last stage ends at unit L
            held += terms.at_end[L] / MIB
        held -= pulp.lpSum(terms.last_unit[l + 1] / MIB * self._last_recomputed(l, g)
                           for (l, gg), r in self.rho.items() if gg == g and terms.last_unit[l + 1])
        return held

    # --- paths ----------------------------------------------------------------------------------
    def add_form(self, form: PathForm, big_m_ms: float) -> None:
        counts = form.count()
        value = pulp.lpSum(n * self.term[t] for t, n in counts.items() if t in self.term)
        guard = 0
        for name, j, i in form.crossings:
            guard += (1 - self.hold.get((name, j), 0)) + (1 - self.hold.get((name, i), 0))
        n = len(self.forms)
        if form.crossings:
            self.add(self.T >= value - big_m_ms * guard, f"path_{n}")
        else:
            self.add(self.T >= value, f"path_{n}")
        self.forms.append(form)

    def warm_start(self, boundaries: Sequence[int], recompute: Sequence[int]) -> None:
        edges = list(boundaries) + [self.L]
        for l in range(self.L):
            for g in range(self.S):
                if isinstance(self.z[l][g], pulp.LpVariable):
                    self.z[l][g].setInitialValue(1 if l < edges[g] else 0)
        for (l, g), r in self.rho.items():
            r.setInitialValue(1 if l in recompute and (g == 0 or edges[g - 1] <= l) and l < edges[g] else 0)

    def solve(self, cutoff_s: Optional[float], time_limit: Optional[float], backend: str, gap: float = 1e-10
              ) -> ProgramResult:
        """Solve to a relative `gap`; cutoff_s: only splits whose T is below it are wanted (an incumbent's)."""
        if backend == "cbc":
            optimal, bound_ms, ran = _run_cbc(self.prob, time_limit, warm=False, gap=gap)
        else:
            constant = float(getattr(self.prob.objective, "constant", 0.0) or 0.0)
            cutoff = None if cutoff_s is None else cutoff_s * MS - constant
            optimal, bound_ms, ran = _run_highs(self.prob, time_limit, cutoff, gap=gap)
        if not ran:
            return ProgramResult(None, [], None, -math.inf, False, False, ran=False)
        constant = float(getattr(self.prob.objective, "constant", 0.0) or 0.0)
        bound = -math.inf if bound_ms is None else (bound_ms + constant) / MS
        if self.prob.sol_status == pulp.LpSolutionInfeasible or self.prob.status == pulp.LpStatusInfeasible:
            return ProgramResult(None, [], None, cutoff_s if cutoff_s is not None else math.inf, True, False)
        if self.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return ProgramResult(None, [], None, bound, optimal, False)
        value = lambda t: float(t) if isinstance(t, (int, float)) else float(pulp.value(t) or 0.0)
        boundaries = [sum(1 for l in range(self.L) if value(self.z[l][g]) > 0.5) for g in range(self.S - 1)]
        if self.opts.recompute == "all":
            chosen = list(range(self.L))
        else:
            chosen = sorted({l for (l, g), r in self.rho.items() if value(r) > 0.5 and value(self.x(l, g)) > 0.5})
        return ProgramResult(boundaries, chosen, value(self.T) / MS + self.opts.step_overhead_s, bound, optimal, True)


def _most(terms) -> float:
    """A bound (MiB) of |a stage's held bytes| under these terms (StageMemory.held's) over every split."""
    return float(sum(np.abs(t).sum() for t in (terms.per_unit, terms.recompute_saves, terms.shared_lost,
                                                 terms.at_start, terms.at_end, terms.last_unit))) / MIB


def big_m_ms(profile: Profile, b: int, opts: CostOptions, form: PathForm) -> float:
    """An upper bound (ms) of a form's value over all splits: every stage as slow as the whole model."""
    c = range_costs(profile, b, opts.optimizer)
    slowest = min(rank_speeds(opts))
    whole = (c.call_forward + c.call_backward + float(c.F[-1] + 2 * c.F[-1] + c.G[-1])) / slowest
    message = max(float(c.act.max(initial=0.0)), float(c.grad.max(initial=0.0)))
    links = boundary_links(opts) or [(opts.bandwidth, opts.latency)]
    per_message = max(lat + message / bw for bw, lat in links) + opts.message_s
    ties = sum(tie_time(size, opts.pipeline_ranks * opts.tie_replicas, opts)
               for _, _, size in shared_parameters(profile))
    reduce = max(reduce_time(float(c.P[-1]), float(c.T[-1]), float(c.FB[-1]), opts, profile.dtype,
                             num_micro_batches(opts, b), i, float(c.COLL[-1]), float(c.BUF[-1]))
                 for i in range(opts.pipeline_ranks)) + \
        float(c.O[-1]) / slowest
    return (sum(form.count().values()) * (whole + per_message) + ties + reduce) * MS * 2 + 1.0

