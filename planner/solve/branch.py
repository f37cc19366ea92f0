"""Branch and bound over the splits of one scenario: the step graph's path forms bound every split
from below, stage after stage.

A form k (a longest path of some split's graph, planner.pipeline.stepgraph) is a sum of duration
terms with counts. Without tied weights or replicated stages every term belongs to one stage g --
its forward and backward (or their input and weight parts), the two messages across boundary g, its
share of its device's gradient exchange (its rings' latency with it, when the stage exchanges
any bytes) and optimizer step -- or is a constant (the cost per message), so for a split
0 = a_0 < e_0 = a_1 < ... < e_{S-1} = L

    form_k(split) = c_k + sum_g V_kg(a_g, e_g)        and        step(split) >= max_k form_k(split)

(the path exists whatever the durations). The search fixes stages in order. At a node whose first g
stages are fixed, with prefix P_k = c_k + sum_{h<g} V_kh(a_h, e_h) and next start a, no completion
is faster than

    max_k ( P_k + D_kg(a) ),     D_kg(a) = min over the splits of [a, L) into stages g..S-1 of sum_{h>=g} V_kh

(each form's own best completion, a dynamic program over (g, a)). With v > 1 a device's forms spread
over stages far apart and each form alone dodges by shrinking its own stages, so combinations join
them (planner.solve.dual): for weights lam >= 0 with sum 1, sum_k lam_k form_k is again a constant
plus per-stage terms and at most max_k form_k, so it is one more form, with its own completions. Its
weights maximise its best split's value min_split sum_k lam_k form_k (the Lagrangian dual; at least
the best single form's), found by cutting planes once the search has run a while (a short search
never pays for it) and again at each refresh; the splits they meet are simulated (candidates, and
their paths new forms). With v = 1 the single forms are already close and the ascent is skipped.
Each form's own best completion still dodges alone; the stage floors (planner.solve.floors) do not:
H_g(a, e), the least step of a split with stage g = [a, e) under every form, bounds every stage at
once, so min over splits of max_g H_g (a min-max partition, M) bounds a node too, and a range
whose floor reaches the incumbent is dropped. The split attaining M is simulated (a candidate), and
its longest path, when no known form has it, joins the forms: the floors are derived again and the
new M's split simulated, round after round while that teaches a new form (cutting planes; at most
a share of the time limit, as each round costs a refresh) -- the splits the relaxation favours are
those whose paths it lacks, and a better plan is often among them.

A node whose bound does not beat the incumbent by more than the gap is cut; a stage that does not
fit its device's memory is never placed. A complete split is simulated: a faster one becomes the
incumbent, and its longest path joins the forms when the known ones undervalued it (so the bound
tightens as the search learns).
When the search ends the incumbent is optimal; at the time limit the least bound of the nodes left
(re-bounded with every form learned) is the proven bound.

A device with several stages (v > 1): its gradient exchange and its optimizer step are sums over
its stages' parameters (linear in the bytes), so each stage carries its share (of the latency,
paid once when any stage exchanges: 1/v per such stage, at most what the split pays); a device's memory
is not a sum of its stages' (the peak of its list), so a stage is placed only where it fits alone
(a necessary condition) and a complete split is kept only if `evaluate` finds it fits. It applies
to every schedule without replicated stages, without tied weights (their all-reduce spans the ranks
holding a use; under ZeRO-3 a frozen one's gathers, too, depend on whether one rank holds two of its
uses: planner.cost.ties) and with recomputation `none` or `all` (fixed per unit).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from planner.cost.model import (boundary_links, collective_latency, evaluate, exchange_latency, num_micro_batches,
                                rank_speeds, shared_parameters, sync_time)
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs, range_matrix
from planner.cost.result import PathForm
from planner.cost.ties import tied_weights
from planner.profile.profile import Profile
from planner.solve.dual import Dual
from planner.solve.floors import (Band, OutOfTime, form_completions, least_largest, nonzero_terms, split_of,
                                  stage_floors)
from planner.solve.reach import stage_conditions
from planner.solve.solution import Split

DUAL_ITERATIONS, DUAL_REFRESH_ITERATIONS = 500, 30  # dual ascent steps at the start and at each refresh
# the dual ascent starts after this many nodes or this share of the time limit (shorter searches never pay for it)
DUAL_AFTER_NODES, DUAL_AFTER_SHARE = 10_000, 0.2
DUAL_SHARE = 0.8  # of the time limit, for the dual ascents (the rest: the search)
FLOOR_ROUNDS = 2  # floors, then completions over the ranges left: at most this many rounds per refresh
CUT_ROUNDS = 50  # refreshes in a row while the floors' split teaches a new form (or beats the incumbent)
CUT_SHARE = 0.3  # of the time limit, at most, for the rounds only a new form asked for
REFRESH = 0.01  # re-derive the allowed stages and completions when the target or the forms moved this much
_STAGE_TERMS = ("forward", "backward", "backward_input", "backward_weight", "act", "grad", "reduce", "step")


TABLE_BYTES = 2 << 30  # beyond, the integer program (BENCHMARKS.md: 0.74 GB at 1,251 units and 16 like stages)


def applies(profile: Profile, opts: CostOptions) -> bool:
    """Whether every duration term of this scenario belongs to one stage (module docstring), on a
    profile small enough for its tables."""
    return (table_bytes(profile.num_units, opts) <= TABLE_BYTES and not opts.replicated
            and opts.recompute in ("none", "all") and not shared_parameters(profile)
            and not (opts.shard == "parameters" and opts.data_parallel > 1 and tied_weights(profile))
            and opts.num_stages <= profile.num_units)


def table_bytes(num_units: int, opts: CostOptions) -> int:
    """What the search's tables over every range take: the stage terms (one table per kind of
    device, at most one per stage where devices differ), the floors and the allowed ranges per stage
    (the band's gathered terms, at most floors.BAND_BYTES, come on top)."""
    S, cells = opts.num_stages, (num_units + 1) ** 2
    tables = S if opts.device_view is not None else 2  # like devices: inner stages and the last one
    return (tables * len(_STAGE_TERMS) * 8 + S * (8 + 3)) * cells


@dataclass
class BranchOutcome:
    best: Optional[Split]
    bound_s: float  # no split of the scenario is faster (seconds, step overhead included)
    optimal: bool  # the search finished
    nodes: int
    forms: Set[PathForm]  # every form used, those learned included


class _Terms:
    """Each stage's duration terms over every range [a, e) (seconds; +inf where e <= a), and where
    each stage fits its device's memory."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions):
        costs = range_costs(profile, b, opts.optimizer)
        L, S = profile.num_units, opts.num_stages
        self.L, self.S = L, S
        redo_all = opts.recompute == "all"
        again = costs.F if redo_all else 0.0
        ranks = [opts.rank_of_stage(g) for g in range(S)]
        device_speeds, links = rank_speeds(opts), boundary_links(opts)
        speeds = [device_speeds[ranks[g]] for g in range(S)]
        m = num_micro_batches(opts, b)
        forward = range_matrix(costs.F) + costs.call_forward
        backward = range_matrix(costs.G + again) + costs.call_backward
        backward_input, backward_weight = costs.split_matrices(again)
        params, trainable, regathered = range_matrix(costs.P), range_matrix(costs.T), range_matrix(costs.FB)
        finite = np.isfinite(params)
        params, trainable = np.where(finite, params, 0.0), np.where(finite, trainable, 0.0)
        regathered = np.where(finite, regathered, 0.0)
        collectives = np.where(finite, range_matrix(costs.COLL), 0.0)
        buffers = np.where(finite, range_matrix(costs.BUF), 0.0)  # averaged under local SGD
        step = range_matrix(costs.O)
        ends = np.arange(L + 1)
        zero = np.zeros((L + 1, L + 1))
        # rows[g][t, a, e] = term t of stage g = [a, e), 0 where not a range
        self.rows: List[np.ndarray] = []
        # stages on like devices share one table: (speed, act, grad, reduce, table) of each kind
        distinct: List[Tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for g in range(S):
            speed = speeds[g]
            exchange = sync_time(params, trainable, regathered, opts, profile.dtype, m, rank=ranks[g],
                                 buffer_bytes=buffers)
            # ZeRO-3 under a placement: one ring's latency per gather and reduce-scatter (planner.cost.model)
            exchange = exchange + m * collectives * collective_latency(opts, ranks[g])
            # the stage's share of its device's exchange over the replicas (hierarchical under a placement:
            # per rank); the device's rings' latency is paid when any of its v stages exchanges bytes: each
            # such stage carries 1/v of it (exact for v = 1; at most the latency, so a bound, for v > 1)
            latency = exchange_latency(opts, ranks[g]) / len(opts.stages_on(ranks[g]))
            reduce = exchange + np.where(exchange > 0, latency, 0.0)
            act = np.array([costs.message_s(e, links[g]) if 0 < e < L and g < S - 1 else 0.0 for e in ends])
            grad = np.array([costs.message_s(e, links[g], gradient=True) if 0 < e < L and g < S - 1 else 0.0
                             for e in ends])  # the messages across boundary g, by where stage g ends
            same = next((table for (v, a, d, r, table) in distinct if v == speed and np.array_equal(a, act)
                         and np.array_equal(d, grad) and np.array_equal(r, reduce)), None)
            if same is None:
                terms = {"forward": forward / speed, "backward": backward / speed,
                         "backward_input": backward_input / speed, "backward_weight": backward_weight / speed,
                         "step": step / speed, "reduce": reduce, "act": np.broadcast_to(act, zero.shape),
                         "grad": np.broadcast_to(grad, zero.shape)}
                stacked = np.stack([terms[name] for name in _STAGE_TERMS])
                same = np.where(finite & np.isfinite(stacked), stacked, 0.0)
                distinct.append((speed, act, grad, reduce, same))
            self.rows.append(same)
        self.nonzero = nonzero_terms(self.rows)
        self.fits = self._memory(profile, b, opts, costs, redo_all, m)
        self.allowed: List[np.ndarray] = []  # fits, and may lie in a split faster than the target (restrict)
        self.band: Optional[Band] = None  # where the allowed ranges lie (planner.solve.floors)
        self.allow(list(self.fits))
        self.costs, self.speeds, self.redo_all, self.ranks = costs, speeds, redo_all, ranks

    def restrict(self, forms: Sequence[PathForm], target: float) -> None:
        """allowed[g][a, e]: stage g = [a, e) fits and meets every form's per-stage condition for a
        step below `target` (planner.solve.reach: a stage too heavy for any split to beat it). Only the
        ranges allowed now are tested: the target only falls and the forms only grow, so no other range
        can come back (and one the floors dropped stays dropped: they only rise)."""
        ok = stage_conditions(self.costs, self.S, self.speeds, [f.count() for f in forms if not f.crossings],
                              target, recompute_all=self.redo_all, within=self.allowed)
        self.allow([fits & good for fits, good in zip(self.fits, ok)])

    def allow(self, allowed: List[np.ndarray]) -> None:
        self.allowed, self.band = allowed, Band(self.rows, allowed, nonzero=self.nonzero)
        # window[g][a] = (first, last + 1): the ends e of stage g = [a, e) that are allowed lie in it (a
        # node reads only those columns; first = last + 1 = 0 where none is)
        self.window = []
        for ok in allowed:
            any_end = ok.any(axis=1)
            first = np.where(any_end, ok.argmax(axis=1), 0)
            stop = np.where(any_end, ok.shape[1] - ok[:, ::-1].argmax(axis=1), 0)
            self.window.append(np.stack([first, stop], axis=1))

    def _memory(self, profile, b, opts, costs, redo_all, m) -> List[np.ndarray]:
        """fits[g][a, e]: stage g = [a, e) fits its device with nothing else on it
        (planner.cost.model.device_memory; exact with one stage per device)."""
        from planner.cost.stage_memory import StageMemory

        memory = StageMemory(profile, b, opts, redo_all)
        valid = np.isfinite(range_matrix(costs.P))
        return [valid if memory.cap(g) is None else valid & (memory.matrix(g) <= memory.cap(g))
                for g in range(self.S)]


class _Forms:
    """The forms as arrays: the constants c_k and per stage g a coefficient matrix (forms x terms)."""

    def __init__(self, terms: _Terms, message_s: float):
        self.terms, self.message_s = terms, message_s
        self.constant = np.zeros(0)
        self.coefficients = np.zeros((terms.S, 0, len(_STAGE_TERMS)))  # [g, k, term]
        self.completion = np.zeros((0, terms.S + 1, terms.L + 1))  # D[k, g, a]
        self.known: Set[PathForm] = set()
        # the stage floors' bound (planner.solve.floors): H_g(a, e) per stage, M[g, a], and the split attaining M
        self.floors: Optional[List[np.ndarray]] = None
        self.floored = 0  # the forms the floors count (the first ones)
        self.least = np.full((terms.S + 1, terms.L + 1), -np.inf)
        self.least_split: Optional[Tuple[int, ...]] = None
        self.refresh_s = 0.0  # how long the last refresh took
        self.deadline: Optional[float] = None  # a refresh past it gives up (time.perf_counter())

    def __len__(self) -> int:
        return len(self.constant)

    def add(self, form: PathForm, complete: bool = True) -> bool:
        """Take a form (False if known, guarded by a tie, or with a term of no stage); without
        `complete`, its completions wait for the next refresh (0 until then: every term is a
        duration, so no completion is below 0)."""
        if form in self.known or form.crossings:
            return False
        S = self.terms.S
        per_stage = np.zeros((S, 1, len(_STAGE_TERMS)))
        constant = 0.0
        on_rank: Dict[int, List[int]] = {}
        for g, rank in enumerate(self.terms.ranks):
            on_rank.setdefault(rank, []).append(g)
        for term, n in form.count().items():
            if term == ("message",):
                constant += n * self.message_s
            elif term[0] in ("reduce", "step") and term[1] in on_rank:  # a device's: the sum over its stages
                for g in on_rank[term[1]]:
                    per_stage[g, 0, _STAGE_TERMS.index(term[0])] += n
            elif term[0] in _STAGE_TERMS and isinstance(term[1], int) and 0 <= term[1] < S:
                per_stage[term[1], 0, _STAGE_TERMS.index(term[0])] += n
            else:
                return False
        self.known.add(form)
        self.constant = np.append(self.constant, constant)
        self.coefficients = np.concatenate([self.coefficients, per_stage], axis=1)
        completion = self._completion(per_stage[:, 0, :]) if complete else np.zeros(self.completion.shape[1:])
        self.completion = np.concatenate([self.completion, completion[None]])
        return True

    def add_combination(self, lam: np.ndarray) -> None:
        """Take sum_k lam_k form_k (lam >= 0, sum 1: planner.solve.dual) as one more form; it is
        no path, so it joins the bound and not `known`."""
        per_stage = np.einsum("k,gkt->gt", lam, self.coefficients)
        self.constant = np.append(self.constant, float(lam @ self.constant))
        self.coefficients = np.concatenate([self.coefficients, per_stage[:, None, :]], axis=1)
        self.completion = np.concatenate([self.completion, self._completion(per_stage)[None]])

    def refresh(self, target: float) -> None:
        """Re-derive the allowed stages for `target`, every form's completions over them, and the stage
        floors; a range whose floor reaches the target is dropped and the completions follow (twice at most)."""
        started, kept = time.perf_counter(), self._tables()
        try:
            self._refresh(target)
        except OutOfTime:
            self._restore(kept)
        self.refresh_s = time.perf_counter() - started

    def _tables(self):
        """The completions, floors and M as they are (a refresh past the deadline puts them back)."""
        return self.completion, self.floors, self.floored, self.least, self.least_split

    def _restore(self, kept) -> None:
        """Past the deadline: the tables from before the refresh. They still bound every split: taken
        over a superset of the ranges allowed now (the target only falls), with the same forms or fewer."""
        self.completion, self.floors, self.floored, self.least, self.least_split = kept

    def _least(self) -> None:  # M and the split attaining it, from the floors of every form counted so far
        self.floored = len(self)
        self.least, ends = least_largest(self.floors)
        self.least_split = split_of(ends) if np.isfinite(self.least[0, 0]) else None

    def extend(self, target: float) -> None:
        """The floors for the same target with the forms added since the last refresh: their floors
        joined to the kept ones, which still hold (taken over a superset of the ranges allowed now, with
        fewer forms), the ranges whose floor reaches the target dropped, M again. A refresh where there
        are no floors to extend. Its time is not the next refresh's estimate (`refresh_s` stays)."""
        if self.floors is None:
            self.refresh(target)
            return
        kept = self._tables()
        try:
            terms, new = self.terms, slice(self.floored, len(self))
            terms.restrict(self.known, target)
            if new.start < new.stop:
                fresh = stage_floors(self.constant[new], self.coefficients[:, new], terms.band,
                                     self.completion[new], self.deadline)
                self.floors = [np.maximum(old, floor) for old, floor in zip(self.floors, fresh)]
            self.floors = [np.where(allowed, floor, np.inf) for allowed, floor in zip(terms.allowed, self.floors)]
            self._drop_reached(target)
            self._least()
        except OutOfTime:
            self._restore(kept)

    def _refresh(self, target: float) -> None:
        terms, deadline = self.terms, self.deadline
        terms.restrict(self.known, target)
        self.completion = form_completions(self.coefficients, terms.band, deadline)
        if not len(self):
            return
        for _ in range(FLOOR_ROUNDS):  # the floors over a superset of the final allowed stages still hold
            self.floors = stage_floors(self.constant, self.coefficients, terms.band, self.completion, deadline)
            if not self._drop_reached(target):
                break
            self.completion = form_completions(self.coefficients, terms.band, deadline)
        self._least()

    def _drop_reached(self, target: float) -> bool:
        """Drop the allowed ranges whose floor reaches the target; whether any was."""
        terms = self.terms
        kept = [allowed & (floor < target) for allowed, floor in zip(terms.allowed, self.floors)]
        if all((k == a).all() for k, a in zip(kept, terms.allowed)):
            return False
        terms.allow(kept)
        return True

    def floor_bound(self, g: int, a: int) -> np.ndarray:
        """Over e: no split with stage g = [a, e) is faster than max(H_g(a, e), M[g + 1, e])."""
        if self.floors is None:
            return self.least[g + 1]
        return np.maximum(self.floors[g][a], self.least[g + 1])

    def stage_value(self, forms: slice, g: int, a: int, ends: slice = slice(None)) -> np.ndarray:
        """V_kg(a, e) for the forms in `forms` and every e in `ends` (all by default): (forms, ends),
        +inf where stage g = [a, e) is not allowed."""
        out = self.coefficients[g, forms] @ self.terms.rows[g][:, a, ends]
        return np.where(self.terms.allowed[g][a][None, ends], out, np.inf)

    def _completion(self, per_stage: np.ndarray) -> np.ndarray:
        """D[g, a] for one form (per_stage[g]: its counts of stage g's terms): its least sum over the
        splits of [a, L) into stages g..S-1."""
        return form_completions(per_stage[:, None, :], self.terms.band)[0]


def branch_and_bound(profile: Profile, b: int, opts: CostOptions, incumbent: Optional[Split],
                     forms: Set[PathForm], time_limit: Optional[float], gap: float = 1e-6,
                     cutoff_s: Optional[float] = None,
                     improve: Optional[Callable[[Split], Split]] = None) -> BranchOutcome:
    """The best split of (scenario, b) with a proof, or the best found and a bound at the time limit.
    `profile` is the compute profile (planner.cost.model.compute_profile); `forms` seed the bound;
    only splits faster than `cutoff_s` (a plan of another scenario) are sought; `improve` (a local
    search) is given each new incumbent at a refresh."""
    started = time.perf_counter()
    terms = _Terms(profile, b, opts)
    L, S = terms.L, terms.S
    known = _Forms(terms, opts.message_s)
    known.deadline = None if time_limit is None else started + time_limit
    for form in forms:
        known.add(form, complete=False)  # the first refresh completes them all at once
    redo = list(range(L)) if opts.recompute == "all" else []
    overhead = opts.step_overhead_s
    best = incumbent
    target = min(best.iteration_s if best is not None else math.inf,
                 cutoff_s if cutoff_s is not None else math.inf) - overhead
    dual, dual_until = Dual(), math.inf if time_limit is None else started + DUAL_SHARE * time_limit

    def offer(split: Optional[Split]) -> None:  # a candidate: the incumbent if faster
        nonlocal best, target
        if split is not None and split.iteration_s - overhead < target:
            best, target = split, split.iteration_s - overhead

    def met(ends: Tuple[int, ...]) -> None:  # a split the dual ascent or the floors attain: simulated, a candidate
        offer(_simulate(profile, list(ends[:-1]), b, opts, redo, known))

    def affordable() -> bool:  # a refresh ends before the time limit (as long as the last one took)
        return time_limit is None or time.perf_counter() + known.refresh_s < started + time_limit

    def refresh() -> None:  # allowed stages, completions and floors for the target; the floors' split a candidate
        # cutting planes: the split attaining M is simulated, and its longest path, when new, is a form
        # the next floors count at that split -- again until it is known (or it beat the incumbent)
        nonlocal cutting_s
        cutting = False  # this round runs only for the last round's new form
        for _ in range(CUT_ROUNDS):
            if not affordable() or cutting and time_limit is not None and cutting_s >= CUT_SHARE * time_limit:
                return
            round_started, before, forms_before = time.perf_counter(), target, len(known)
            if cutting:  # the same target: the new forms' floors joined to the others
                known.extend(target * (1 - gap))
            else:
                known.refresh(target * (1 - gap))
            if known.least_split is not None and known.least_split not in tried:
                tried.add(known.least_split)
                met(known.least_split)
            fresh = best is not None and tuple(best.boundaries) not in improved
            if improve is not None and fresh and affordable():
                improved.add(tuple(best.boundaries))
                offer(improve(best))
            if cutting:
                cutting_s += time.perf_counter() - round_started
            if target < before:
                cutting = False
            elif len(known) > forms_before:
                cutting = True
            else:
                break

    def strengthen(iterations: int) -> None:  # the allowed stages for the target, then the dual's combination
        refresh()
        single = float((known.constant + known.completion[:, 0, 0]).max(initial=-math.inf))
        if not dualized or single >= target * (1 - gap) or opts.virtual_stages == 1:
            return
        before = target
        lam, value = dual.ascend(known, met, dual_until, iterations, lambda: target * (1 - gap))
        if lam is not None and value > single:
            known.add_combination(lam)
        if target < before:  # a split the ascent met is the new incumbent
            refresh()

    nodes, dualized, cutting_s = 0, False, 0.0
    tried: Set[Tuple[int, ...]] = set()  # the floors' splits simulated
    improved: Set[Tuple[int, ...]] = set()  # the incumbents given to `improve`
    refresh()  # the allowed stages for the target (the dual joins later, if at all)
    refreshed = (target, len(known))
    # a node: (bound, stage g, start a, the split's boundaries so far, prefix per form known then)
    stack: List[Tuple[float, int, int, Tuple[int, ...], np.ndarray]] = [
        (-math.inf, 0, 0, (), known.constant.copy())]
    while stack:
        if time_limit is not None and time.perf_counter() - started > time_limit:
            share = FINAL_REFRESH_SHARE * time_limit
            bound = min(_open_bound(known, stack, target * (1 - gap), known.refresh_s < share, share),
                        target * (1 - gap))
            return BranchOutcome(best, max(bound, 0.0) + overhead, False, nodes, known.known)
        bound, g, a, cuts, prefix = stack.pop()
        if bound >= target * (1 - gap):
            continue
        nodes += 1
        if not dualized and (nodes >= DUAL_AFTER_NODES or time_limit is not None and
                             time.perf_counter() - started > DUAL_AFTER_SHARE * time_limit):
            dualized = True  # a search not over soon: the dual's combination joins the bound
            strengthen(DUAL_ITERATIONS)
            refreshed = (target, len(known))
        if len(prefix) < len(known):  # forms learned since this node was made: their prefix from its cuts
            prefix = np.concatenate([prefix, _prefix(known, slice(len(prefix), len(known)), cuts)])
        if g == S - 1:  # the last stage is [a, L): a complete split
            offer(_simulate(profile, list(cuts), b, opts, redo, known))
            if target < refreshed[0] * (1 - REFRESH) or len(known) > refreshed[1] * (1 + REFRESH) + 4:
                strengthen(DUAL_REFRESH_ITERATIONS)  # tighter: nodes made before keep their (valid) bounds
                refreshed = (target, len(known))
            continue
        # the ends allowed for stage g = [a, e) lie in its window; the later stages need a unit each
        first, stop = terms.window[g][a]
        stop = min(int(stop), L - (S - 1 - g) + 1)
        if first >= stop:
            continue
        window = slice(int(first), stop)
        every = slice(0, len(known))
        value = known.stage_value(every, g, a, window)  # (forms, ends in the window)
        own = (prefix[:, None] + value + known.completion[:, g + 1, window]).max(axis=0, initial=-math.inf)
        # the parent's bound holds for its children
        bounds = np.maximum(np.maximum(own, known.floor_bound(g, a)[window]), bound)
        ends = np.flatnonzero(bounds < target * (1 - gap))
        # worst first: the best is expanded next (by the bound, then by the forms' own where the floors tie)
        for j in ends[np.lexsort((own[ends], bounds[ends]))[::-1]]:
            e = int(first) + int(j)
            stack.append((float(bounds[j]), g + 1, e, cuts + (e,), prefix + value[:, j]))
    # nothing left beats the target by more than the gap
    return BranchOutcome(best, target * (1 - gap) + overhead, True, nodes, known.known)


FINAL_REFRESH_SHARE = 0.05  # at the time limit, a last refresh when one takes less than this share of it, and
# at most this share again to re-bound the open nodes with every form learned


def _open_bound(known: _Forms, stack, target: float, refresh: bool, budget_s: float = math.inf) -> float:
    """The least bound of the nodes left open: each re-bounded with every form known now and (with
    `refresh`) the completions for the final target (a node's bound was computed when it was made, with
    fewer forms: the shallow ones, made first, are the weakest). Nodes go least bound first, so the
    walk stops at the first whose own bound reaches the least found (no later one can be below it)
    or after `budget_s` seconds (the next node's own bound then stands for the rest)."""
    if not stack:
        return math.inf
    if refresh:  # cheap (the caller's judgement): past the search's deadline, but let it finish
        known.deadline = None
        known.refresh(target)
    deadline = time.perf_counter() + budget_s
    every = slice(0, len(known))
    least = math.inf
    for bound, g, a, cuts, _ in sorted(stack, key=lambda node: node[0]):
        if least <= bound:
            break
        if time.perf_counter() > deadline:
            return min(least, bound)
        redone = float((_prefix(known, every, cuts) + known.completion[:, g, a]).max(initial=-math.inf))
        redone = max(redone, float(known.least[g, a]))
        least = min(least, max(bound, redone))
    return least


def _prefix(known: _Forms, forms: slice, cuts: Sequence[int]) -> np.ndarray:
    """c_k + sum over the fixed stages of V_kh, for the forms in `forms`."""
    total = np.array(known.constant[forms], dtype=float)
    a = 0
    for h, e in enumerate(cuts):
        total = total + known.stage_value(forms, h, a)[:, e]
        a = e
    return total


def _simulate(profile: Profile, cuts: List[int], b: int, opts: CostOptions, redo: List[int],
              known: _Forms) -> Optional[Split]:
    """The split's cost (its longest path joins the forms); None if it does not fit."""
    try:
        cost = evaluate(profile, cuts, b, opts, redo)
    except ValueError:
        return None
    known.add(cost.critical_path)
    return Split(cost.iteration_s, list(cuts), list(redo)) if cost.feasible else None
