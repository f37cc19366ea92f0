"""The integer program: micro-batch size and stage split chosen jointly, optimality proven.

Disjunctive (convex-hull) formulation. For every candidate micro-batch size b (profiled, divides
G, and admitting at least one memory-feasible split) there is a binary y_b, with

    sum_b y_b = 1                                                    (one micro-batch size)

and a private copy of the split variables that is switched on by y_b. Prefix (staircase) form:

    z^b[l][s] = 1  iff  y_b = 1 and unit l is in a stage <= s      (l < L, s < S)

    z^b[l][S-1] = y_b                                (every unit is in some stage)
    z^b[l][s]   = y_b  for s >= l                    (unit l is in a stage <= l)
    z^b[l][s]   = 0    for s < S - L + l             (the L-1-l later units need S-1-s later stages)
    z^b[l][s] >= z^b[l+1][s]                         (contiguity: stage index non-decreasing in l)
    z^b[l][s] <= z^b[l][s+1]                         (prefix form)
    z^b[l][s] <= z^b[l+1][s+1]                       (stage s+1 is non-empty)

Derived linear expressions (x: unit in stage, e: cut k ends stage s):

    x^b[l][s] = z^b[l][s] - z^b[l][s-1]
    e^b[k][s] = z^b[k-1][s] - z^b[k][s]            (k = 1..L-1, s = 0..S-2)
    T^b_s = sum_l x^b[l][s] w_l + sum_k e^b[k][s-1] c_k [s > 0] + sum_k e^b[k][s] c_k [s < S-1]

with w_l = forward + backward of unit l at b and c_k the cut time (planner.costmodel). Then

    Tmax_b >= T^b_s                                   for every s
    Tmax_b >= y_b * LB_b      (LB_b: exact min over memory-feasible splits of max_s T_s, by the DP
                               of planner.solve.diagnose; LB_b >= max_l w_l and >= sum_l w_l / S)
    M^b_s = sum_l x^b[l][s] (P_l (2 + opt) + inflight_{s,b} A_l(b)) <= cap * y_b

    minimise  sum_b [ sum_s T^b_s + (m_b - 1) Tmax_b ]

Since every copy but the chosen one is all zero, the objective is the cost model's iteration time
of the chosen (b, split). Times are in milliseconds and memory in MiB inside the model.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import pulp

from planner.costmodel import (CostOptions, PlanCost, candidate_micro_batch_sizes, cut_times, evaluate,
                               in_flight, optimizer_factor)
from planner.profile import Profile
from planner.solve.diagnose import infeasible_error, min_bottleneck

MS = 1e3  # seconds -> milliseconds
MIB = float(2 ** 20)  # bytes -> MiB (a power of two: the division is exact)
OPTIMALITY_GAP = 1e-6  # a solution within this relative gap of the bound is reported as optimal


@dataclass
class Solution:
    boundaries: List[int]
    micro_batch_size: int
    num_micro_batches: int
    cost: PlanCost
    status: str  # "optimal" | "feasible" (stopped early; gap reported)
    objective: float  # iteration time in seconds of this plan, per the cost model
    bound: float  # proven lower bound on the optimal iteration time, seconds
    gap: float  # (objective - bound) / objective
    seconds: float  # wall time of the solve
    method: str  # "ilp" | "brute"
    backend: str  # "cbc" | "highs" | "python"


@dataclass
class _Copy:
    """The variables of one candidate micro-batch size b."""

    b: int
    m: int
    y: pulp.LpVariable
    tmax: pulp.LpVariable
    z: List[List[object]]  # z[l][s]: an LpVariable, or the expression y_b, or 0
    free: List[pulp.LpVariable]


def _new_variable(prob: pulp.LpProblem, name: str, low: Optional[float] = None,
                  cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    """A variable of `prob`: PuLP >= 3.3 wants prob.add_variable, older versions LpVariable."""
    if cat == pulp.LpBinary:
        low, high, cat = 0, 1, pulp.LpInteger
    else:
        high = None
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, high, cat=cat)
    return pulp.LpVariable(name, low, high, cat=cat)


def _build_copy(prob: pulp.LpProblem, profile: Profile, opts: CostOptions, b: int,
                lower_bound_ms: float) -> Tuple[_Copy, pulp.LpAffineExpression]:
    """Add one disjunct (micro-batch size b) to `prob`; return it and its objective term."""
    L, S = profile.num_units, opts.num_stages
    m = opts.global_batch // b
    y = _new_variable(prob, f"y_{b}", cat=pulp.LpBinary)
    tmax = _new_variable(prob, f"tmax_{b}", low=0.0)
    z: List[List[object]] = []
    free: List[pulp.LpVariable] = []
    for l in range(L):
        row: List[object] = []
        for s in range(S):
            if s >= l or s == S - 1:
                row.append(y)  # unit l is in a stage <= l <= s
            elif s < S - L + l:
                row.append(0)  # units l..L-1 need stages s+1..S-1 at least
            else:
                var = _new_variable(prob, f"z_{b}_{l}_{s}", cat=pulp.LpBinary)
                free.append(var)
                row.append(var)
        z.append(row)

    def add(constraint: object, name: str) -> None:
        if isinstance(constraint, pulp.LpConstraint) and len(constraint) > 0:
            prob.addConstraint(constraint, name)

    free_ids = {id(v) for v in free}

    def either_free(*terms: object) -> bool:  # constraints between fixed values hold by construction
        return any(id(t) in free_ids for t in terms)

    for l in range(L):
        for s in range(S):
            if l + 1 < L and either_free(z[l][s], z[l + 1][s]):
                add(z[l][s] >= z[l + 1][s], f"contiguous_{b}_{l}_{s}")  # z[l][s] >= z[l+1][s]
            if s + 1 < S and either_free(z[l][s], z[l][s + 1]):
                add(z[l][s] <= z[l][s + 1], f"prefix_{b}_{l}_{s}")  # z[l][s] <= z[l][s+1]
            if l + 1 < L and s + 1 < S and either_free(z[l][s], z[l + 1][s + 1]):
                add(z[l][s] <= z[l + 1][s + 1], f"nonempty_{b}_{l}_{s}")  # z[l][s] <= z[l+1][s+1]

    def x(l: int, s: int) -> object:  # x[l][s] = z[l][s] - z[l][s-1]: unit l is in stage s
        return z[l][s] - (z[l][s - 1] if s > 0 else 0)

    def ends(k: int, s: int) -> object:  # e[k][s] = z[k-1][s] - z[k][s]: cut k ends stage s
        return z[k - 1][s] - z[k][s]

    work = [(u.forward_s[b] + u.backward_s[b]) * MS for u in profile.units]  # w_l, ms
    cut = [c * MS for c in cut_times(profile, b, opts)]  # c_k, ms (cut[0] unused)
    opt = optimizer_factor(opts.optimizer)
    for s in range(S):
        stage_time = pulp.lpSum(work[l] * x(l, s) for l in range(L) if s <= l <= L - S + s)
        if s > 0:
            stage_time += pulp.lpSum(cut[k] * ends(k, s - 1) for k in range(1, L) if cut[k] != 0)
        if s < S - 1:
            stage_time += pulp.lpSum(cut[k] * ends(k, s) for k in range(1, L) if cut[k] != 0)
        add(tmax >= stage_time, f"bottleneck_{b}_{s}")  # Tmax_b >= T^b_s
        if opts.memory_cap is not None:
            held = in_flight(s, S, m, opts.schedule)
            memory = pulp.lpSum(
                (u.param_bytes * (2 + opt) + held * u.saved_bytes[b]) / MIB * x(l, s)
                for l, u in enumerate(profile.units) if s <= l <= L - S + s)
            add(memory <= _cap_mib(profile, opts) * y, f"memory_{b}_{s}")  # M^b_s <= cap y_b
    # Tmax_b >= y_b LB_b: LB_b, the DP's exact min bottleneck at b, dominates max_l w_l and
    # sum_l w_l / S; relaxed by 1e-9 relative so that float rounding never cuts off the optimum.
    add(tmax >= y * lower_bound_ms * (1 - 1e-9), f"bottleneck_floor_{b}")
    # sum_s T^b_s = y_b sum_l w_l + 2 sum_k c_k (cut k used), used = sum_{s<S-1} e[k][s]
    used_cuts = pulp.lpSum(2 * cut[k] * ends(k, s) for k in range(1, L) for s in range(S - 1) if cut[k] != 0)
    objective = sum(work) * y + used_cuts + (m - 1) * tmax
    return _Copy(b=b, m=m, y=y, tmax=tmax, z=z, free=free), objective


def _cap_mib(profile: Profile, opts: CostOptions) -> float:
    """The memory cap in MiB; rounded down to whole bytes when every memory term is integral."""
    cap = float(opts.memory_cap)
    if float(optimizer_factor(opts.optimizer)).is_integer():
        cap = math.floor(cap)  # integral M_s <= cap iff M_s <= floor(cap): absorbs solver tolerance
    return cap / MIB


def _value(term: object) -> float:
    return float(pulp.value(term) or 0.0) if not isinstance(term, (int, float)) else float(term)


def _decode(copies: List[_Copy], num_units: int, num_stages: int) -> Optional[Tuple[int, List[int]]]:
    """(b, boundaries) of the chosen disjunct: stage s ends at cut sum_l z[l][s]."""
    chosen = [c for c in copies if _value(c.y) > 0.5]
    if len(chosen) != 1:
        return None
    c = chosen[0]
    boundaries = [sum(1 for l in range(num_units) if _value(c.z[l][s]) > 0.5) for s in range(num_stages - 1)]
    return c.b, boundaries


_CBC_BOUND = re.compile(r"^Lower bound:\s*(\S+)", re.M)
_CBC_OBJECTIVE = re.compile(r"^Objective value:\s*(\S+)", re.M)


def _parse_cbc_log(text: str) -> Tuple[Optional[str], Optional[float], Optional[float]]:
    """(result line, objective, lower bound) from a CBC log; the bound is rounded down to be safe.

    CBC prints 'Result - Optimal solution found' (no 'Lower bound' line: bound = objective) or
    'Result - Stopped on time limit' followed by 'Objective value:', 'Lower bound:', 'Gap:'. The
    bound is printed with few decimals, so half a unit of the last printed digit is subtracted.
    """
    result = re.search(r"^Result - (.*)$", text, re.M)
    objective = _CBC_OBJECTIVE.search(text)
    bound = _CBC_BOUND.search(text)
    value = None
    if bound:
        try:
            value = float(bound.group(1))
            digits = bound.group(1).split(".")[1] if "." in bound.group(1) else ""
            if "e" not in bound.group(1).lower():
                value -= 0.5 * 10.0 ** (-len(digits))
        except ValueError:
            value = None
    obj = None
    if objective:
        try:
            obj = float(objective.group(1))
        except ValueError:
            obj = None
    return (result.group(1).strip() if result else None), obj, value


CBC_ATTEMPTS = 3  # the bundled CBC 2.10.3 sometimes segfaults when its time limit strikes mid-phase


def _run_cbc(prob: pulp.LpProblem, time_limit: Optional[float], warm: bool) -> Tuple[bool, Optional[float], bool]:
    """Solve with CBC; (proven optimal, best bound in model units or None, solver ran).

    A crashed run (pulp raises PulpSolverError) is retried with 1.5x the time limit, since the
    crash depends on where the limit interrupts the solver; after CBC_ATTEMPTS crashes the
    third element is False and the caller falls back to the warm start.
    """
    limit = time_limit
    for _ in range(CBC_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="planner-cbc-") as scratch:
            log_path = os.path.join(scratch, "cbc.log")
            with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC; it is what we ship with
                warnings.simplefilter("ignore", DeprecationWarning)
                solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, logPath=log_path, gapRel=1e-10,
                                           warmStart=warm)
            solver.tmpDir = scratch  # MPS/solution files land here and go away even after a crash
            try:
                prob.solve(solver)
            except pulp.PulpSolverError:
                limit = None if limit is None else limit * 1.5
                continue
            with open(log_path, "r", encoding="utf-8", errors="replace") as f:
                result, objective, bound = _parse_cbc_log(f.read())
        optimal = prob.sol_status == pulp.LpSolutionOptimal and result is not None and result.startswith("Optimal")
        if optimal and bound is None:
            bound = objective  # CBC proved optimality: its bound is its objective
        return optimal, bound, True
    return False, None, False


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null for the duration (C libraries write there directly)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run_highs(prob: pulp.LpProblem, time_limit: Optional[float]) -> Tuple[bool, Optional[float], bool]:
    """Solve with HiGHS through highspy; (proven optimal, MIP dual bound in model units or None, True)."""
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=1e-10, gapAbs=1e-9)
    if not solver.available():
        raise RuntimeError("the highs backend needs highspy: pip install highspy")
    with _quiet_stdout():  # highspy prints a banner on stdout when a model is created
        prob.solve(solver)
    info = prob.solverModel.getInfo()
    bound = float(getattr(info, "mip_dual_bound", float("nan")))
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    return optimal, (bound if math.isfinite(bound) else None), True


def analytic_bound(profile: Profile, opts: CostOptions, floors: Dict[int, float]) -> float:
    """A lower bound without the solver (seconds): min_b sum_l w_l + 2 (S-1 cheapest cuts) + (m-1) LB_b."""
    best = math.inf
    for b, floor in floors.items():
        cuts = sorted(cut_times(profile, b, opts)[1:])[: opts.num_stages - 1]
        work = sum(u.forward_s[b] + u.backward_s[b] for u in profile.units)
        best = min(best, work + 2 * sum(cuts) + (opts.global_batch // b - 1) * floor)
    return best


def solve_ilp(profile: Profile, opts: CostOptions, time_limit: Optional[float] = None,
              backend: str = "cbc", warm_start: bool = True) -> "Solution":
    """Optimal (b, split) for the cost model, with a proven bound. Raises InfeasibleError.

    With warm_start (default) the DP's min-bottleneck split is given to CBC as a start and kept
    if the solver returns nothing better (e.g. on a time limit); without it, the answer is the
    solver's alone (tests use this to check the integer program by itself).
    """
    opts.validate()
    if backend not in ("cbc", "highs"):
        raise ValueError(f"unknown ILP backend {backend!r}; use 'cbc' or 'highs'")
    started = time.perf_counter()
    L, S = profile.num_units, opts.num_stages
    if S > L or not candidate_micro_batch_sizes(profile, opts.global_batch):
        raise infeasible_error(profile, opts)
    # Exact per-b min bottleneck (memory-feasible): drops b with no feasible split, bounds Tmax_b,
    # and its split is the warm start.
    floors: Dict[int, float] = {}
    heuristic: Optional[Tuple[float, int, List[int]]] = None
    for b in candidate_micro_batch_sizes(profile, opts.global_batch):
        floor, boundaries = min_bottleneck(profile, b, opts)
        if boundaries is None:
            continue
        floors[b] = floor
        cost = evaluate(profile, boundaries, b, opts)
        if cost.feasible and (heuristic is None or (cost.iteration_s, b) < heuristic[:2]):
            heuristic = (cost.iteration_s, b, boundaries)
    if not floors or heuristic is None:
        raise infeasible_error(profile, opts)

    prob = pulp.LpProblem("pipeline_plan", pulp.LpMinimize)
    copies: List[_Copy] = []
    objective = 0
    for b, floor in floors.items():
        copy, term = _build_copy(prob, profile, opts, b, floor * MS)
        copies.append(copy)
        objective = objective + term
    prob += objective
    prob.addConstraint(pulp.lpSum(c.y for c in copies) == 1, "one_micro_batch_size")
    if warm_start:
        _set_warm_start(copies, heuristic[1], heuristic[2], profile, opts)

    if backend == "cbc":
        solver_optimal, bound_ms, ran = _run_cbc(prob, time_limit, warm=warm_start)
    else:
        solver_optimal, bound_ms, ran = _run_highs(prob, time_limit)

    plan = None
    if ran and prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        decoded = _decode(copies, L, S)
        if decoded is not None:
            try:
                cost = evaluate(profile, decoded[1], decoded[0], opts)
                if cost.feasible:
                    plan = (cost.iteration_s, decoded[0], decoded[1])
            except ValueError:
                plan = None
    if plan is None and not warm_start:
        raise RuntimeError(f"the {backend} solver returned no plan ({'status ' + pulp.LpStatus[prob.status] if ran else 'it crashed'}); "
                           "give it more time or enable the warm start")
    if warm_start and (plan is None or heuristic[0] < plan[0]):
        # The solver returned nothing, or something worse than the warm start (time limit, or
        # tolerances): keep the warm start; it is optimal only if the solver's optimum matches it.
        solver_optimal = solver_optimal and plan is not None and math.isclose(plan[0], heuristic[0], rel_tol=1e-9)
        plan = heuristic
    iteration, b, boundaries = plan
    cost = evaluate(profile, boundaries, b, opts)
    bound = analytic_bound(profile, opts, floors)
    if bound_ms is not None:
        bound = max(bound, bound_ms / MS)
    bound = min(bound, iteration)
    gap = max(0.0, (iteration - bound) / iteration) if iteration > 0 else 0.0
    if solver_optimal and gap <= OPTIMALITY_GAP:
        bound, gap = iteration, 0.0
    status = "optimal" if gap <= 1e-12 or (solver_optimal and gap <= OPTIMALITY_GAP) else "feasible"
    return Solution(boundaries=list(boundaries), micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                    cost=cost, status=status, objective=iteration, bound=bound, gap=gap,
                    seconds=time.perf_counter() - started, method="ilp", backend=backend)


def _set_warm_start(copies: List[_Copy], b: int, boundaries: List[int], profile: Profile, opts: CostOptions) -> None:
    """Initial values for every variable: the chosen copy encodes `boundaries`, the others are 0."""
    edges = list(boundaries) + [profile.num_units]
    for c in copies:
        on = c.b == b
        c.y.setInitialValue(1 if on else 0)
        for l, row in enumerate(c.z):
            for s, term in enumerate(row):
                if isinstance(term, pulp.LpVariable) and term is not c.y:
                    term.setInitialValue(1 if on and l < edges[s] else 0)
        if on:
            cost = evaluate(profile, boundaries, b, opts)
            c.tmax.setInitialValue(cost.bottleneck_s * MS)
        else:
            c.tmax.setInitialValue(0)
