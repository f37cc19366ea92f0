"""The step graph's linear relaxation: the least step of any fractional split, and its dual as one form.

A split 0 = e_{-1} < e_0 < ... < e_{S-1} = L is a staircase y[g, u] = [e_g >= u] (g < S - 1,
1 <= u <= L) with

    y[g, u] >= y[g, u + 1]          (a staircase)
    y[g, u + 1] >= y[g - 1, u]      (e_g >= e_{g-1} + 1: no stage is empty)

difference rows only, so the matrix is totally unimodular: a linear objective's least value over
fractional y is taken at a split. A stage term t_g(a, e) = A[a] + B[e] (every term the lists charge
per range, where separable over the ranges stage g can hold; otherwise taken as 0, which lowers no
path above its value: durations are >= 0) is linear in y: B[e_g] = B[0] + sum_u (B[u] - B[u-1]) y[g, u].
The step graph of the lists (planner.pipeline.stepgraph) gives each node n an end E_n with

    E_n >= E_p + edge(p, n) + own(n)     for each predecessor p (p = start: E_p = 0)
    T >= E_last(r)                       for each rank r

(a node with one predecessor is an expression, E_p + its durations, not a column: nothing else bounds
it from below), and min T over fractional y is a lower bound of every split's step (the LP); where
each stage's end is confined to a window (the search's ranges for its target: `allowed`), of every
split in them. Its dual is a flow through the graph: a convex combination of the graph's paths (the
start to a rank's end), whose weights on the duration terms make one form f(split) = c + sum_g w_g .
t_g(a_g, e_g), below every split's step (each path is) and, by total unimodularity, as low at its best
split as the LP. The flow is read from the LP's duals and made exact by a backward pass (each node's
outflow split over its incoming edges in the duals' proportions), so the form is a combination of
paths whatever the solver's tolerances; its least value over the allowed splits is what it proves
(planner.solve.forms' completions). The branch and bound takes it as one more form: on interleaved
and bfs lists, where each form alone dodges by shrinking its own stages, it holds every path at once.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from planner.cost.model import num_micro_batches, step_shape
from planner.cost.options import CostOptions
from planner.cost.step import step_graph
from planner.solve.backends import quiet_stdout
from planner.solve.floors import OutOfTime, check_deadline
from planner.solve.forms import STAGE_TERMS, stages_on_ranks, term_parts

try:
    import highspy
except ImportError:  # a core dependency; without it the search goes without this form
    highspy = None

LP_NONZEROS = 400_000  # beyond, the program takes seconds (BENCHMARKS.md): the search goes without it
SEPARABLE_TOL = 1e-9  # relative: a table this close to A[a] + B[e] is taken as separable


@dataclass
class FlowForm:
    """The flow's form: constant + sum_g per_stage[g] . t_g (STAGE_TERMS order), and the LP's value
    (`lp_s`, to the interior point method's tolerance: the form's least split is the bound it proves)."""

    constant: float
    per_stage: np.ndarray
    lp_s: float


def separable(table: np.ndarray, g: int, S: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """(A, B) with table[a, e] = A[a] + B[e] over the ranges stage g of S can hold (a = 0 for the first,
    a in g..L-S+g for the others; e = L for the last, e in a+1..L-S+g+1 for the others), or None."""
    L = table.shape[0] - 1
    a_lo, a_hi, e_hi = g, (0 if g == 0 else L - S + g), L - S + g + 1
    e_lo = L if g == S - 1 else a_lo + 1
    B = np.zeros(L + 1)
    A = np.zeros(L + 1)
    B[e_lo:e_hi + 1] = table[a_lo, e_lo:e_hi + 1]
    A[a_lo:a_hi + 1] = table[a_lo:a_hi + 1, e_hi] - table[a_lo, e_hi]
    a, e = np.arange(a_lo, a_hi + 1)[:, None], np.arange(e_lo, e_hi + 1)[None, :]
    ranges = e > a  # the block's entries that are ranges
    if not ranges.any():
        return A, B
    block = table[a_lo:a_hi + 1, e_lo:e_hi + 1]
    scale = float(np.abs(block[ranges]).max())
    error = float(np.abs(block - A[a] - B[e])[ranges].max())
    return (A, B) if error <= SEPARABLE_TOL * scale else None


@dataclass
class FlowTimes:
    """How long the programs of one solve took: (nonzeros, seconds) of each solved. A program expected
    to overrun the time left is not started (`expected_s`)."""

    solved: List[Tuple[int, float]] = field(default_factory=list)

    def expected_s(self, nonzeros: int) -> float:
        """How long a program of this many nonzeros should take, from the largest one solved so far (the
        interior point method's time grows faster than its size: scaled by the size's square above it,
        linearly below); 0 before any."""
        if not self.solved:
            return 0.0
        size, seconds = max(self.solved)
        ratio = nonzeros / size
        return seconds * (ratio ** 2 if ratio > 1 else ratio)


@dataclass
class ScenarioFlow:
    """One scenario's relaxation across its searches in a solve: its form once solved (a bound of every
    split, whatever windows it was solved over: a later search of the scenario starts with it) and the
    solve's program times (shared by its scenarios)."""

    times: FlowTimes = field(default_factory=FlowTimes)
    form: Optional[FlowForm] = None


def flow_form(rows: Sequence[np.ndarray], ranks: Sequence[int], opts: CostOptions, b: int, message_s: float,
              time_limit: Optional[float] = None, allowed: Optional[Sequence[np.ndarray]] = None,
              times: Optional[FlowTimes] = None) -> Optional[FlowForm]:
    """The LP's form for stage term tables `rows[g][term, a, e]` (planner.solve.forms.StageTerms) of
    the scenario's lists with micro-batch size b, over the splits whose stages end where `allowed[g][a, e]`
    lets them (the branch and bound's ranges for its target: the LP sharper for the splits it seeks, the
    form a bound of every split); None where no split is allowed, the program is too large, does not
    finish in `time_limit` seconds, `times` (the solve's programs so far, this one joins them) expects it
    not to, or HiGHS is missing."""
    times = FlowTimes() if times is None else times
    if highspy is None or time_limit is not None and time_limit <= 0:
        return None
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    S, L = len(rows), rows[0].shape[1] - 1
    windows = end_windows(S, L, allowed)
    if windows is None or _size(rows, windows) > LP_NONZEROS:
        return None
    try:
        graph = step_graph(step_shape(opts, num_micro_batches(opts, b)))
        program = _Program(rows, ranks, graph, message_s, windows, deadline)
        if deadline is not None and time.perf_counter() + times.expected_s(program.nonzeros()) > deadline:
            return None  # it would not end in time: the search keeps that time
        solving = time.perf_counter()
        solved = program.solve(None if deadline is None else deadline - time.perf_counter())
        if solved is not None:
            times.solved.append((program.nonzeros(), time.perf_counter() - solving))
    except OutOfTime:
        return None
    if solved is None:
        return None
    value, duals = solved
    per_stage = np.zeros((S, len(STAGE_TERMS)))
    constant = 0.0
    for term, w in program.path_weights(duals).items():
        if term == ("message",):
            constant += w * message_s
        # a collective's term is dropped: the form stays below each path
        for g, t in term_parts(term, S, program.on_rank) or ():
            per_stage[g, t] += w
    return FlowForm(constant, per_stage, value)


def _size(rows: Sequence[np.ndarray], windows: Sequence[Tuple[int, int]]) -> int:
    """About the program's nonzeros but the graph's: the staircases' rows (two entries each, two rows per
    end a window leaves open) and each stage term's row (its stage's two windows), before any is built."""
    S = len(rows)
    widths = [0] + [hi - lo + 1 for lo, hi in windows] + [0]  # stage g's start: window g - 1, its end: g
    terms = sum(int(table[g].any()) for g in range(S) for table in rows[g])  # their first start's row: O(L)
    return 4 * sum(widths) + terms * (1 + 2 * max(widths))


def end_windows(S: int, L: int, allowed: Optional[Sequence[np.ndarray]] = None) -> Optional[List[Tuple[int, int]]]:
    """[lo_g, hi_g] for each stage g < S - 1: where its end can lie (some allowed range ends there, every
    stage holds a unit), narrowed so that each window follows the one before; None where one is empty."""
    lo = [g + 1 for g in range(S - 1)]
    hi = [L - (S - 1 - g) for g in range(S - 1)]
    for g in range(S - 1):
        if allowed is not None:
            ends = np.nonzero(allowed[g].any(axis=0))[0]
            if not ends.size:
                return None
            lo[g], hi[g] = max(lo[g], int(ends[0])), min(hi[g], int(ends[-1]))
        if g > 0:
            lo[g] = max(lo[g], lo[g - 1] + 1)
    for g in range(S - 3, -1, -1):
        hi[g] = min(hi[g], hi[g + 1] - 1)
    if any(l > h for l, h in zip(lo, hi)):
        return None
    return list(zip(lo, hi))


class _Program:
    """The LP (module docstring) as rows: y, then one column per node end, T, then one column per
    stage term (= its linear function of y) and one for the per-message cost."""

    def __init__(self, rows: Sequence[np.ndarray], ranks: Sequence[int], graph, message_s: float,
                 windows: Sequence[Tuple[int, int]], deadline: Optional[float] = None):
        S, L = len(rows), rows[0].shape[1] - 1
        self.S, self.L, self.graph = S, L, graph
        inf = highspy.kHighsInf
        # y[g, u] is a column for lo_g < u <= hi_g (e_g in [lo_g, hi_g]); 1 below, 0 above
        self.windows = list(windows)
        self._y_first, ny = [], 0
        for lo, hi in self.windows:
            self._y_first.append(ny - (lo + 1))  # column of y[g, u] = first + u
            ny += hi - lo
        self.t_col = ny  # T; then a column per node with several predecessors, and per term
        self.col_lower = [0.0] * (ny + 1)
        self.col_upper = [1.0] * ny + [inf]
        self.index: List[int] = []
        self.value: List[float] = []
        self.start = [0]
        self.lower: List[float] = []
        self.upper: List[float] = []
        for g, (lo, hi) in enumerate(self.windows):  # rows with a column only (the windows make the rest hold)
            for u in range(max(1, lo), min(L - 1, hi) + 1):
                self._row_y({(g, u): 1.0, (g, u + 1): -1.0}, {}, 0.0, inf)  # a staircase
            if g > 0:  # e_g >= e_{g-1} + 1
                before = self.windows[g - 1]
                for u in range(max(1, min(lo - 1, before[0] + 1)), min(L - 1, max(hi - 1, before[1])) + 1):
                    self._row_y({(g, u + 1): 1.0, (g - 1, u): -1.0}, {}, 0.0, inf)
        check_deadline(deadline)
        self._tables, self._stage_col = rows, {}
        self.on_rank, self._message = stages_on_ranks(ranks), self._fixed(message_s)
        self._term_cols: Dict[tuple, List[int]] = {}
        # a node with one predecessor ends at its predecessor's end plus its durations (nothing else
        # bounds it from below), an expression; one with several gets a column, a row per predecessor
        self.edges: List[Tuple[int, int, Optional[tuple], Optional[int]]] = []  # (node, pred, edge term, row)
        ends: List[Dict[int, float]] = []
        for n, node in enumerate(graph.nodes):
            if n % 1024 == 0:
                check_deadline(deadline)
            own: Dict[int, float] = {}
            for term in node.terms:
                for k in self._columns(term):
                    own[k] = own.get(k, 0.0) + 1.0
            preds = node.preds or [(-1, None)]
            column = self._column(0.0) if len(preds) > 1 else None
            for p, edge in preds:
                expression = dict(ends[p]) if p >= 0 else {}
                for k, x in own.items():
                    expression[k] = expression.get(k, 0.0) + x
                for k in self._columns(edge) if edge is not None else ():
                    expression[k] = expression.get(k, 0.0) + 1.0
                if column is None:
                    self.edges.append((n, p, edge, None))
                    ends.append(expression)
                else:
                    self.edges.append((n, p, edge, len(self.lower)))
                    row = {k: -x for k, x in expression.items()}
                    row[column] = 1.0
                    self._row(row, 0.0, inf)
            if column is not None:
                ends.append({column: 1.0})
        self.last_rows = []
        for last in graph.rank_last:
            self.last_rows.append((last, len(self.lower)))
            row = {k: -x for k, x in ends[last].items()}
            row[self.t_col] = 1.0
            self._row(row, 0.0, inf)

    def _y(self, g: int, u: int):
        """y[g, u]: its column, or its value (1.0 or 0.0) outside stage g's window of ends."""
        lo, hi = self.windows[g]
        return 1.0 if u <= lo else 0.0 if u > hi else self._y_first[g] + u

    def _row_y(self, ys: Dict[Tuple[int, int], float], others: Dict[int, float], lower: float, upper: float) -> None:
        """lower <= sum ys[g, u] y[g, u] + sum others[k] x_k <= upper, the fixed y moved to the bounds;
        none where no column is left (the windows make it hold)."""
        row, fixed = dict(others), 0.0
        for (g, u), coef in ys.items():
            k = self._y(g, u)
            if isinstance(k, float):
                fixed += coef * k
            else:
                row[k] = row.get(k, 0.0) + coef
        if row:
            self._row(row, lower - fixed, upper - fixed)

    def _row(self, row: Dict[int, float], lower: float, upper: float) -> None:
        self.index += row.keys()
        self.value += row.values()
        self.start.append(len(self.index))
        self.lower.append(lower)
        self.upper.append(upper)

    def _column(self, lower: float = -math.inf) -> int:
        self.col_lower.append(max(lower, -highspy.kHighsInf))
        self.col_upper.append(highspy.kHighsInf)
        return len(self.col_lower) - 1

    def _fixed(self, value: float) -> int:
        k = self._column()
        self._row({k: 1.0}, value, value)
        return k

    def _columns(self, term: tuple) -> List[int]:
        """The columns whose sum is the term's duration (none for a term no stage owns: taken as 0)."""
        if term not in self._term_cols:
            if term == ("message",):
                cols = [self._message]
            else:
                cols = [self._stage(g, t) for g, t in term_parts(term, self.S, self.on_rank) or ()]
            self._term_cols[term] = [k for k in cols if k is not None]
        return self._term_cols[term]

    def _stage(self, g: int, t: int) -> Optional[int]:
        """The column of stage g's term t (A[a_g] + B[e_g]); None where the table is 0 or not separable."""
        if (g, t) not in self._stage_col:
            table = self._tables[g][t]
            parts = separable(table, g, self.S) if table.any() else None
            if parts is None:
                self._stage_col[(g, t)] = None
            else:
                k, ys, constant = self._column(), {}, 0.0
                for h, vector in ((g - 1, parts[0]), (g, parts[1])):
                    if h < 0 or h >= self.S - 1:  # e_{-1} = 0, e_{S-1} = L
                        constant += float(vector[0 if h < 0 else self.L])
                        continue
                    constant += float(vector[0])  # B[e] = B[0] + sum_{u <= e} (B[u] - B[u - 1])
                    step = np.diff(vector)
                    for u in np.nonzero(step)[0]:
                        ys[(h, int(u) + 1)] = -float(step[u])
                self._row_y(ys, {k: 1.0}, constant, constant)
                self._stage_col[(g, t)] = k
        return self._stage_col[(g, t)]

    def nonzeros(self) -> int:
        return len(self.index)

    def solve(self, time_limit: Optional[float]) -> Optional[Tuple[float, np.ndarray]]:
        """(T, row duals) at the optimum; None where HiGHS stops short of it."""
        if time_limit is not None and time_limit <= 0:
            return None
        with quiet_stdout():
            h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("solver", "ipm")  # several times faster than simplex here (BENCHMARKS.md)
        h.setOptionValue("threads", 1)
        h.setOptionValue("run_crossover", "off")  # path_weights makes any duals a combination of paths
        if time_limit is not None:
            h.setOptionValue("time_limit", float(time_limit))
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(self.col_lower), len(self.lower)
        cost = np.zeros(lp.num_col_)
        cost[self.t_col] = 1.0
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.array(self.col_lower), np.array(self.col_upper)
        lp.row_lower_, lp.row_upper_ = np.array(self.lower), np.array(self.upper)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(self.start, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(self.value, dtype=float)
        h.passModel(lp)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        return float(h.getInfo().objective_function_value), np.asarray(h.getSolution().row_dual, dtype=float)

    def path_weights(self, duals: np.ndarray) -> Dict[tuple, float]:
        """The flow's weight on each duration term: a unit of flow from the ranks' ends (in the duals'
        proportions) passed back through the graph, each node's outflow split over its incoming
        edges in their duals' proportions (the first edge where all are 0): an exact convex
        combination of the graph's paths."""
        graph = self.graph
        # HiGHS's duals of these >= rows are >= 0 at a minimum; the sign is read, not assumed
        sign = 1.0 if sum(duals[r] for _, r in self.last_rows) >= 0 else -1.0
        share = np.maximum(sign * np.where(np.isfinite(duals), duals, 0.0), 0.0)
        out = np.zeros(len(graph.nodes))
        ends = np.array([share[r] for _, r in self.last_rows])
        ends = ends / ends.sum() if ends.sum() > 0 else np.eye(len(ends))[0]
        for (last, _), w in zip(self.last_rows, ends):
            out[last] += w
        incoming: Dict[int, List[Tuple[int, Optional[tuple], int]]] = {}
        for n, p, edge, r in self.edges:
            incoming.setdefault(n, []).append((p, edge, r))
        weights: Dict[tuple, float] = {}
        for n in range(len(graph.nodes) - 1, -1, -1):  # nodes come after their predecessors
            flow = out[n]
            if flow <= 0:
                continue
            for term in graph.nodes[n].terms:
                weights[term] = weights.get(term, 0.0) + flow
            edges = incoming[n]
            parts = np.array([1.0 if r is None else share[r] for _, _, r in edges])
            parts = parts / parts.sum() if parts.sum() > 0 else np.eye(len(edges))[0]
            for (p, edge, _), part in zip(edges, parts):
                if part <= 0:
                    continue
                if edge is not None:
                    weights[edge] = weights.get(edge, 0.0) + flow * part
                if p >= 0:
                    out[p] += flow * part
        return weights
