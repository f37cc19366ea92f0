"""The integer program for one scenario (p, d, v, schedule, micro-batch size b): boundaries and
recomputation chosen jointly, optimality proven. planner.solve.search enumerates the scenarios.

Prefix (staircase) form over C = p v stages: z[l][c] = 1 iff unit l is in a stage <= c, with

    z[l][C-1] = 1;  z[l][c] = 1 for c >= l;  z[l][c] = 0 for c < C - L + l   (stages are non-empty)
    z[l][c] >= z[l+1][c]     (contiguity)        z[l][c] <= z[l][c+1]    (prefix)
    z[l][c] <= z[l+1][c+1]   (stage c+1 non-empty)
    x[l][c] = z[l][c] - z[l][c-1]  (unit l in stage c);  e[k][c] = z[k-1][c] - z[k][c] (cut k ends c)

Variable fixing by prefix sums. With an incumbent of value U, any better plan has
max_i D_i <= tau = (U - G / v) / (m - 1/v) (G: a lower bound on sum_c T_c: total work over the fastest rank,
or the DP's unconstrained min sum when v = 1),
and every stage time T_c <= tau. Units 0..l in stages <= c need W(0, l+1) <= (c+1) tau sigma_max,
so z[l][c] = 0 otherwise; units l..L-1 in stages > c need W(l, L) <= (C-1-c) tau sigma_max, so
z[l][c] = 1 otherwise. On balanced chains this leaves each unit one or two possible stages.

Recomputation ('auto', with a memory cap): rho[l][c] <= x[l][c] for units with s_l > in_l;
stage c's time gains f_l / sigma rho[l][c] and its memory loses h_c (s_l - in_l) rho[l][c].

    T_c   = k / sigma_c + sum_l x[l][c] w_l / sigma_c + sum_l rho[l][c] f_l / sigma_c   (k: a stage's own cost)
            + sum_k e[k][c-1] t_k^{c-1} [c > 0] + sum_k e[k][c] t_k^c [c < C-1]
    Dmax >= sum_{c on i} T_c (each rank i);   Dmax >= LB (exact min-max DP value when v = 1)
    M_i   = sum_{c on i} sum_l x[l][c] (P_l (2 + opt) + h_c s_l) - rho terms  <= cap_i
    Emax >= sum_{c on i} (sum_l x[l][c] ar_l + tie_c)           (ar_l: all-reduce of P_l over d)
    tied parameter t with uses u_1 < ... < u_n: sep_j >= sum_c e[k][c] for cuts u_j < k <= u_{j+1},
    hold_c >= x[u][c], tie_c >= 2 bytes_t / bw (sum_j sep_j - (n - 1)(1 - hold_c)), tie_c >= 0
    minimise (1/v) sum_c T_c + (m - 1/v) Dmax + Emax + step_overhead   (a constant)

Times are in milliseconds and memory in MiB inside the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import pulp

from planner.cost.model import (allreduce_time, boundary_links, cut_times, held_counts, input_bytes,
                                num_micro_batches, optimizer_factor, rank_caps, rank_speeds, shared_parameters,
                                stage_call_s)
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.solve.backends import _run_cbc, _run_highs
from planner.solve.solution import Split

MS = 1e3  # seconds -> milliseconds
MIB = float(2 ** 20)  # bytes -> MiB
@dataclass
class ScenarioResult:
    """What the solver said about one scenario: its plan (boundaries None: none) and a proven lower bound."""

    boundaries: Optional[List[int]]
    recompute: List[int]  # units recomputed in backward
    bound_s: float
    optimal: bool


def _no_plan(bound_s: float, optimal: bool) -> ScenarioResult:
    return ScenarioResult(boundaries=None, recompute=[], bound_s=bound_s, optimal=optimal)


class _NoPlanUnderBound(Exception):
    """Fixed variables contradict each other: no split has every stage time under the bound."""


def _var(prob: pulp.LpProblem, name: str, binary: bool = False) -> pulp.LpVariable:
    low, high, cat = (0, 1, pulp.LpInteger) if binary else (0.0, None, pulp.LpContinuous)
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, high, cat=cat)
    return pulp.LpVariable(name, low, high, cat=cat)


def _fixings(profile: Profile, b: int, opts: CostOptions, tau: float) -> Tuple[List[int], List[int]]:
    """For each unit l: the lowest and highest stage it may occupy given max stage time tau (s)."""
    L, C = profile.num_units, opts.num_stages
    fastest = max(rank_speeds(opts))
    work = np.concatenate([[0.0], np.cumsum([u.forward_s[b] + u.backward_s[b] for u in profile.units])]) / fastest
    slack = tau * (1 + 1e-9) + 1e-15
    low, high = [], []
    for l in range(L):
        lo = max(0, l - (L - C), math.ceil(work[l + 1] / slack - 1 - 1e-12))  # W(0,l+1) <= (c+1) tau
        hi = min(C - 1, l, C - 1 - math.ceil((work[L] - work[l]) / slack - 1e-12) + 1)  # W(l,L) <= (C-c) tau
        low.append(min(lo, C - 1))
        high.append(max(hi, 0))
    return low, high


class _Program:
    """The integer program of one scenario at one micro-batch size (module docstring), built piece
    by piece in a fixed order (the order of variables and rows is the solvers' input)."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, low: List[int], high: List[int]):
        self.profile, self.b, self.opts, self.low, self.high = profile, b, opts, low, high
        self.L, self.C, self.p = profile.num_units, opts.num_stages, opts.pipeline_ranks
        self.units = profile.units
        self.prob = pulp.LpProblem("pipeline_plan", pulp.LpMinimize)
        self.z: List[List[object]] = []  # z[l][c] = 1 iff unit l is in a stage <= c (a constant where fixed)
        for l in range(self.L):
            row: List[object] = []
            for c in range(self.C):
                if c >= high[l]:
                    row.append(1)  # unit l sits in a stage <= high[l] <= c
                elif c < low[l]:
                    row.append(0)
                else:
                    row.append(_var(self.prob, f"z_{l}_{c}", binary=True))
            self.z.append(row)
        self.rho: Dict[Tuple[int, int], pulp.LpVariable] = {}  # (unit, stage): recomputed there

    def add(self, constraint: object, name: str) -> None:
        if isinstance(constraint, pulp.LpConstraint) and len(constraint) > 0:
            self.prob.addConstraint(constraint, name)
        elif (isinstance(constraint, bool) and not constraint) or \
                (isinstance(constraint, pulp.LpConstraint) and not constraint.valid(1e-9)):
            raise _NoPlanUnderBound(name)  # constants alone violate it: no plan in this scenario

    def x(self, l: int, c: int) -> object:
        """1 iff unit l is in stage c."""
        return self.z[l][c] - (self.z[l][c - 1] if c > 0 else 0)

    def ends(self, k: int, c: int) -> object:
        """1 iff cut k ends stage c."""
        return self.z[k - 1][c] - self.z[k][c]

    def may(self, l: int, c: int) -> bool:
        return self.low[l] <= c <= self.high[l]

    def cut_may_end(self, k: int, c: int) -> bool:  # cut k can end stage c: unit k-1 in c, unit k in c+1
        return self.may(k - 1, c) and self.may(k, c + 1)

    def add_staircase(self) -> None:
        for l in range(self.L):
            for c in range(self.C):
                if l + 1 < self.L:
                    self.add(self.z[l][c] >= self.z[l + 1][c], f"contiguous_{l}_{c}")
                if c + 1 < self.C:
                    self.add(self.z[l][c] <= self.z[l][c + 1], f"prefix_{l}_{c}")
                if l + 1 < self.L and c + 1 < self.C:
                    self.add(self.z[l][c] <= self.z[l + 1][c + 1], f"nonempty_{l}_{c}")

    def add_recomputation(self, candidates: List[int]) -> None:
        """rho[l][c] <= x[l][c] for each unit that recomputation would shrink."""
        for l in candidates:
            for c in range(self.low[l], self.high[l] + 1):
                self.rho[l, c] = _var(self.prob, f"r_{l}_{c}", binary=True)
                self.add(self.rho[l, c] <= self.x(l, c), f"recompute_in_stage_{l}_{c}")

    def stage_times(self, work: List[float], speeds: List[float], links) -> List[object]:
        """T_c (ms) of every stage: its own cost, its units' work and recomputation, its transfers."""
        b, L, C, p = self.b, self.L, self.C, self.p
        cut_ms = [[t * MS for t in cut_times(self.profile, b, self.opts, link)] for link in links]
        call_ms = stage_call_s(self.profile, b) * MS
        times = []
        for c in range(C):
            sigma = speeds[c % p]
            t = call_ms / sigma + pulp.lpSum(work[l] / sigma * self.x(l, c) for l in range(L) if self.may(l, c))
            t += pulp.lpSum(self.units[l].forward_s[b] * MS / sigma * r for (l, cc), r in self.rho.items() if cc == c)
            if c > 0:
                t += pulp.lpSum(cut_ms[c - 1][k] * self.ends(k, c - 1) for k in range(1, L)
                                if cut_ms[c - 1][k] and self.cut_may_end(k, c - 1))
            if c < C - 1:
                t += pulp.lpSum(cut_ms[c][k] * self.ends(k, c) for k in range(1, L)
                                if cut_ms[c][k] and self.cut_may_end(k, c))
            times.append(t)
        return times

    def add_busiest_rank(self, stage_time: List[object], floor_s: float) -> object:
        """Dmax >= every rank's work per micro-batch, and >= the proven floor."""
        dmax = _var(self.prob, "dmax")
        for i in range(self.p):
            self.add(dmax >= pulp.lpSum(stage_time[c] for c in range(i, self.C, self.p)), f"busiest_rank_{i}")
        self.add(dmax >= floor_s * MS * (1 - 1e-9), "busiest_rank_floor")
        return dmax

    def add_memory(self, caps: List[Optional[float]], held: List[int], saved: List[float], inputs: List[int]) -> None:
        """M_i <= cap_i on every capped rank."""
        b, L, C, p = self.b, self.L, self.C, self.p
        opt = optimizer_factor(self.opts.optimizer)
        for i in range(p):
            if caps[i] is None:
                continue
            memory = pulp.lpSum((self.units[l].param_bytes * (2 + opt) + held[c] * saved[l]) / MIB * self.x(l, c)
                                for c in range(i, C, p) for l in range(L) if self.may(l, c))
            memory -= pulp.lpSum(held[c] * (self.units[l].saved_bytes[b] - inputs[l]) / MIB * r
                                 for (l, c), r in self.rho.items() if c % p == i)
            cap = math.floor(caps[i]) if opt.is_integer() else caps[i]
            self.add(memory <= cap / MIB, f"memory_rank_{i}")

    def set_objective(self, stage_time: List[object], dmax: object, m: int) -> None:
        """(1/v) sum_c T_c + (m - 1/v) Dmax + Emax + the per-step constant."""
        opts, v = self.opts, self.opts.virtual_stages
        extra_terms = _extra_terms(self.prob, self.profile, opts, self.x, self.ends, self.may, self.add)
        objective = pulp.lpSum(stage_time) * (1.0 / v) + (m - 1.0 / v) * dmax + opts.per_step_s * MS
        if extra_terms is not None:
            emax = _var(self.prob, "emax")
            for i in range(self.p):
                self.add(emax >= pulp.lpSum(extra_terms[c] for c in range(i, self.C, self.p)), f"extra_rank_{i}")
            objective += emax
        self.prob += objective

    def warm_start(self, incumbent: Split) -> None:
        edges = list(incumbent.boundaries) + [self.L]
        for l in range(self.L):
            for c in range(self.C):
                if isinstance(self.z[l][c], pulp.LpVariable):
                    self.z[l][c].setInitialValue(1 if l < edges[c] else 0)
        for (l, c), r in self.rho.items():
            r.setInitialValue(1 if l in incumbent.recompute and (c == 0 or edges[c - 1] <= l) and l < edges[c] else 0)

    def read_plan(self, redo_all: bool) -> Optional[Tuple[List[int], List[int]]]:
        """(boundaries, recomputed units) of the solver's solution, None without one."""
        if self.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return None
        value = lambda t: float(t) if isinstance(t, (int, float)) else float(pulp.value(t) or 0.0)
        boundaries = [sum(1 for l in range(self.L) if value(self.z[l][c]) > 0.5) for c in range(self.C - 1)]
        chosen = sorted({l for (l, c), r in self.rho.items() if value(r) > 0.5 and value(self.x(l, c)) > 0.5})
        return boundaries, list(range(self.L)) if redo_all else chosen


def build_and_solve(profile: Profile, b: int, opts: CostOptions, incumbent: Optional[Split], dmax_floor_s: float,
                    total_floor_s: float, time_limit: Optional[float], backend: str, warm_start: bool
                    ) -> ScenarioResult:
    """Solve the scenario's program; the incumbent bounds it (variable fixing, cutoff) and warm-starts it."""
    L, C, v = profile.num_units, opts.num_stages, opts.virtual_stages
    m = num_micro_batches(opts, b)
    speeds, caps, held, links = rank_speeds(opts), rank_caps(opts), held_counts(opts, m), boundary_links(opts)
    redo_all = opts.recompute == "all"
    work = [(u.forward_s[b] + u.backward_s[b] + (u.forward_s[b] if redo_all else 0.0)) * MS for u in profile.units]
    inputs = input_bytes(profile, b)
    saved = [inputs[l] if redo_all else u.saved_bytes[b] for l, u in enumerate(profile.units)]
    total_work = max((sum(work) / MS + C * stage_call_s(profile, b)) / max(speeds), total_floor_s)  # sum_c T_c >= this
    tau = math.inf
    if incumbent is not None:
        beat = incumbent.iteration_s - opts.per_step_s
        tau = beat if m * v == 1 else min(beat, (beat - total_work / v) / (m - 1.0 / v))
    low, high = _fixings(profile, b, opts, tau) if math.isfinite(tau) else ([max(0, l - (L - C)) for l in range(L)],
                                                                            [min(C - 1, l) for l in range(L)])
    beaten = incumbent.iteration_s if incumbent else math.inf  # what "nothing here beats the incumbent" proves
    if any(lo > hi for lo, hi in zip(low, high)):
        return _no_plan(beaten, optimal=True)
    program = _Program(profile, b, opts, low, high)
    try:
        program.add_staircase()
        program.add_recomputation([l for l, u in enumerate(profile.units) if u.saved_bytes[b] > inputs[l]]
                                  if opts.recompute == "auto" and any(cap is not None for cap in caps) else [])
        stage_time = program.stage_times(work, speeds, links)
        dmax = program.add_busiest_rank(stage_time, dmax_floor_s)
        program.add_memory(caps, held, saved, inputs)
        program.set_objective(stage_time, dmax, m)
    except _NoPlanUnderBound:  # fixings or constants leave no plan: nothing beats the incumbent here
        return _no_plan(beaten, optimal=True)
    warm = warm_start and incumbent is not None
    if warm:
        program.warm_start(incumbent)
    return _run(program, backend, time_limit, incumbent if warm else None, warm_start, redo_all, beaten)


def _run(program: _Program, backend: str, time_limit: Optional[float], incumbent: Optional[Split],
         warm_start: bool, redo_all: bool, beaten: float) -> ScenarioResult:
    """Run the MIP backend (warm-started from, and cut off at, `incumbent` when given) and read its answer."""
    prob = program.prob
    constant = float(getattr(prob.objective, "constant", 0.0) or 0.0)
    if backend == "cbc":
        optimal, bound_ms, ran = _run_cbc(prob, time_limit, warm=incumbent is not None)
    else:  # only plans beating the incumbent matter
        cutoff = incumbent.iteration_s * MS - constant if incumbent is not None else None
        optimal, bound_ms, ran = _run_highs(prob, time_limit, cutoff)
    if not ran:
        if not warm_start:
            raise RuntimeError(f"the {backend} solver returned no plan (it crashed); give it more time or "
                               "enable the warm start")
        return _no_plan(-math.inf, optimal=False)
    if prob.sol_status == pulp.LpSolutionInfeasible or prob.status == pulp.LpStatusInfeasible:
        # Infeasible with fixings derived from the incumbent: nothing beats the incumbent here.
        return _no_plan(beaten, optimal=True)
    plan = program.read_plan(redo_all)
    if plan is None and not warm_start:
        raise RuntimeError(f"the {backend} solver returned no plan (status {pulp.LpStatus[prob.status]}); "
                           "give it more time or enable the warm start")
    if bound_ms is not None:  # solvers report the bound without the objective's constant term
        bound_ms += constant
    bound = -math.inf if bound_ms is None else bound_ms / MS  # search() takes the max with its analytic bound
    return ScenarioResult(boundaries=plan[0] if plan else None, recompute=plan[1] if plan else [], bound_s=bound,
                          optimal=optimal)


def _extra_terms(prob, profile: Profile, opts: CostOptions, x, ends, may, add) -> Optional[List[object]]:
    """Per-stage per-iteration time (ms): all-reduce of its parameters over d, plus tied exchange."""
    C = opts.num_stages
    ties = shared_parameters(profile)
    if opts.data_parallel == 1 and not ties:
        return None
    terms: List[object] = []
    for c in range(C):
        terms.append(pulp.lpSum(allreduce_time(u.param_bytes, opts) * MS * x(l, c)
                                for l, u in enumerate(profile.units) if may(l, c) and u.param_bytes))
    for t_index, (_, uses, size) in enumerate(ties):
        if len(uses) < 2:
            continue
        kappa = 2.0 * size / opts.bandwidth * MS
        seps = []
        for j in range(len(uses) - 1):
            sep = _var(prob, f"tie_sep_{t_index}_{j}")
            for k in range(uses[j] + 1, uses[j + 1] + 1):
                add(sep >= pulp.lpSum(ends(k, c) for c in range(C - 1) if may(k - 1, c) and may(k, c + 1)),
                    f"tie_sep_{t_index}_{j}_{k}")
            seps.append(sep)
        for c in range(C):
            if not any(may(u, c) for u in uses):
                continue
            hold = _var(prob, f"tie_hold_{t_index}_{c}")
            for u in uses:
                if may(u, c):
                    add(hold >= x(u, c), f"tie_hold_{t_index}_{c}_{u}")
            share = _var(prob, f"tie_share_{t_index}_{c}")
            add(share >= kappa * (pulp.lpSum(seps) - (len(uses) - 1) * (1 - hold)), f"tie_share_{t_index}_{c}")
            terms[c] = terms[c] + share
    return terms
