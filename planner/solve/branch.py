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
With v > 1 the linear relaxation of the lists' graph (planner.solve.flow_bound) gives one more
combination, of every path at once (its flow), when the search has run as long as the dual waits for.
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
(re-bounded with every form learned) is the proven bound, or, where higher, what the floors prove for a
target below the incumbent's (a split faster than T has every stage allowed for T, so every split is at
least min(T, M(T)), and M(T) rises as T falls: `_probed_bound`, in the time kept for it at the end; a
search the probes leave time for goes on).

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
from typing import Callable, List, Optional, Sequence, Set, Tuple

import numpy as np

from planner.cost.model import evaluate, shared_parameters
from planner.cost.options import CostOptions
from planner.cost.result import PathForm
from planner.cost.ties import tied_weights
from planner.profile.profile import Profile
from planner.solve.dual import Dual
from planner.solve.floors import OutOfTime
from planner.solve.flow_bound import ScenarioFlow, flow_form
from planner.solve.forms import TABLE_BYTES, Forms, StageTerms, form_prefix, table_bytes
from planner.solve.recompute import recompute_for
from planner.solve.recompute_bound import bounded
from planner.solve.solution import Candidate

DUAL_ITERATIONS, DUAL_REFRESH_ITERATIONS = 500, 30  # dual ascent steps at the start and at each refresh
# the dual ascent starts after this many nodes or this share of the time limit (shorter searches never pay for it)
DUAL_AFTER_NODES, DUAL_AFTER_SHARE = 10_000, 0.2
DUAL_SHARE = 0.8  # of the time limit, for the dual ascents (the rest: the search)
CUT_ROUNDS = 50  # refreshes in a row while the floors' split teaches a new form (or beats the incumbent)
CUT_SHARE = 0.3  # of the time limit, at most, for the rounds only a new form asked for
_largest = np.maximum.reduce  # a node's bound: the ufunc's own method (ndarray.max's Python wrapper costs 2 us)
FLOW_SHARE = 0.3  # of the time limit, at most, for the linear relaxation's flow (planner.solve.flow_bound)
REFRESH = 0.01  # re-derive the allowed stages and completions when the target or the forms moved this much


def applies(profile: Profile, opts: CostOptions, chosen: bool = False) -> bool:
    """Whether every duration term of this scenario belongs to one stage (module docstring), on a
    profile small enough for its tables; with `chosen`, also where each split's recomputation is
    chosen (`--recompute auto` with one stage per device: the search's terms then bound it,
    planner.solve.recompute_bound, and a leaf's own choice may exceed them)."""
    fixed = opts.recompute in ("none", "all") or chosen and bounded(opts)
    return (table_bytes(profile.num_units, opts) <= TABLE_BYTES and not opts.replicated
            and fixed and not shared_parameters(profile)
            and not (opts.shard == "parameters" and opts.data_parallel > 1 and tied_weights(profile))
            and opts.num_stages <= profile.num_units)


@dataclass
class BranchOutcome:
    best: Optional[Candidate]
    bound_s: float  # no split of the scenario is faster (seconds, step overhead included)
    optimal: bool  # the search finished
    nodes: int
    forms: Set[PathForm]  # every form used, those learned included


def branch_and_bound(profile: Profile, b: int, opts: CostOptions, incumbent: Optional[Candidate],
                     forms: Set[PathForm], time_limit: Optional[float], gap: float = 1e-6,
                     cutoff_s: Optional[float] = None,
                     improve: Optional[Callable[[Candidate, Optional[float]], Candidate]] = None,
                     flow: Optional[ScenarioFlow] = None) -> BranchOutcome:
    """The best split of (scenario, b) with a proof, or the best found and a bound at the time limit.
    `profile` is the compute profile (planner.cost.compute_dtype.compute_profile); `forms` seed the bound;
    only splits faster than `cutoff_s` (a plan of another scenario) are sought; `improve` (a local
    search) is given each new incumbent at a refresh, and the time (time.perf_counter()) it must end by;
    `flow` keeps the scenario's linear relaxation between its searches (solved once, by the first that
    needs it)."""
    flow = ScenarioFlow() if flow is None else flow
    started = time.perf_counter()
    deadline = None if time_limit is None else started + time_limit
    try:
        terms = StageTerms(profile, b, opts, deadline)
    except OutOfTime:  # no node searched: the incumbent, and no bound but that every duration is >= 0
        return BranchOutcome(incumbent, opts.step_overhead_s, False, 0, set(forms))
    L, S = terms.L, terms.S
    known = Forms(terms, opts.message_s)
    known.deadline = deadline
    for form in forms:
        known.add(form, complete=False)  # the first refresh completes them all at once
    if flow.form is not None:  # solved by an earlier search of this scenario
        known.add_weighted(flow.form.constant, flow.form.per_stage)
    # the units recomputed: fixed, or (recompute 'auto' under a cap) chosen per split, the terms then
    # a bound a split's own choice may exceed: the least such leaf bound stands for those leaves
    redo = None if terms.redo_bound else list(range(L)) if opts.recompute == "all" else []
    loose = math.inf
    overhead = opts.step_overhead_s
    best = incumbent
    target = min(best.iteration_s if best is not None else math.inf,
                 cutoff_s if cutoff_s is not None else math.inf) - overhead
    dual, dual_until = Dual(), math.inf if time_limit is None else started + DUAL_SHARE * time_limit

    def offer(split: Optional[Candidate]) -> None:  # a candidate: the incumbent if faster
        nonlocal best, target
        if split is not None and split.iteration_s - overhead < target:
            best, target = split, split.iteration_s - overhead

    def met(ends: Tuple[int, ...]) -> None:  # a split the dual ascent or the floors attain: simulated, a candidate
        offer(_simulate(profile, list(ends[:-1]), b, opts, redo, known))

    def searching_until() -> Optional[float]:  # the search's own time: the limit less what is kept for the bound
        return None if time_limit is None else started + time_limit - _final_share(known, time_limit)

    def affordable() -> bool:  # a refresh ends in the search's time (as long as the last one took)
        return time_limit is None or time.perf_counter() + known.refresh_s < searching_until()

    def open_bound() -> float:  # every split's bound at the time limit: the open nodes', re-bounded in a share of it
        share = FINAL_REFRESH_SHARE * time_limit
        return min(_open_bound(known, stack, target * (1 - gap), known.refresh_s < share, share),
                   target * (1 - gap), loose)

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
                offer(improve(best, searching_until()))
            if cutting:
                cutting_s += time.perf_counter() - round_started
            if target < before:
                cutting = False
            elif len(known) > forms_before:
                cutting = True
            else:
                break

    def strengthen(iterations: int) -> None:  # the allowed stages for the target, then the dual's combination
        nonlocal flowed
        if dualized and not flowed and opts.virtual_stages > 1:  # each form alone dodges: the flow holds them all
            flowed = True
            # in what is left of the limit after it and a refresh (the probes may have begun)
            left = None if time_limit is None else \
                min(FLOW_SHARE * time_limit, started + time_limit - time.perf_counter() - 2 * known.refresh_s)
            flow.form = flow_form(terms.rows, terms.ranks, opts, b, opts.message_s, left, terms.allowed, flow.times)
            if flow.form is not None:
                known.add_weighted(flow.form.constant, flow.form.per_stage)
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

    nodes, dualized, cutting_s, flowed = 0, False, 0.0, flow.form is not None
    tried: Set[Tuple[int, ...]] = set()  # the floors' splits simulated
    improved: Set[Tuple[int, ...]] = set()  # the incumbents given to `improve`
    refresh()  # the allowed stages for the target (the dual joins later, if at all)
    refreshed = (target, len(known))
    # a node: (bound, stage g, start a, the split's boundaries so far, prefix per form known then)
    stack: List[Tuple[float, int, int, Tuple[int, ...], np.ndarray]] = [
        (-math.inf, 0, 0, (), known.constant.copy())]
    proven = None  # the bound at the probes below the incumbent's target (`_probed_bound`), once
    while stack:
        if time_limit is not None and proven is None and time.perf_counter() > searching_until():
            bound = open_bound()
            # the floors for lower targets than the incumbent's prove more (`_probed_bound`); the probes
            # leave the nodes and the tables as they were, so a search they leave time for goes on
            proven = max(bound, _probed_bound(known, bound, target * (1 - gap), started + time_limit))
            known.deadline = deadline
        if time_limit is not None and time.perf_counter() - started > time_limit:
            # the probes' bound holds for every split, whatever the incumbent since
            bound = open_bound() if proven is None else min(proven, target)
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
            prefix = np.concatenate([prefix, form_prefix(known, slice(len(prefix), len(known)), cuts)])
        if g == S - 1:  # the last stage is [a, L): a complete split
            found = _simulate(profile, list(cuts), b, opts, redo, known)
            offer(found)
            if redo is None:  # its recomputation chosen: exact only where it meets the terms' bound
                below = _split_bound(known, cuts + (L,))
                if below < target * (1 - gap) and (found is None or found.iteration_s - overhead > below * (1 + 1e-9)):
                    loose = min(loose, max(bound, below))
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
        # (forms, ends in the window); the floors are +inf where a stage is not allowed (once there are any)
        value = known.stage_value(every, g, a, window, masked=known.floors is None)
        own = _largest(prefix[:, None] + value + known.completion[:, g + 1, window], axis=0, initial=-math.inf)
        # the parent's bound holds for its children
        bounds = np.maximum(np.maximum(own, known.floor_bound(g, a, window)), bound)
        ends = (bounds < target * (1 - gap)).nonzero()[0]
        if not len(ends):
            continue
        # worst first: the best is expanded next (by the bound, then by the forms' own where the floors tie)
        ends = ends[np.lexsort((own[ends], bounds[ends]))[::-1]]
        prefixes = (prefix[:, None] + value[:, ends]).T.copy()  # each child's, one row apiece
        for j, child in zip(ends.tolist(), prefixes):
            e = int(first) + j
            stack.append((float(bounds[j]), g + 1, e, cuts + (e,), child))
    # nothing left beats the target by more than the gap (but the leaves whose recomputation was chosen
    # above their bound: the least of those bounds)
    bound = min(target * (1 - gap), loose)
    return BranchOutcome(best, max(bound, 0.0) + overhead, loose >= target * (1 - gap), nodes, known.known)


FINAL_REFRESH_SHARE = 0.05  # at the time limit, a last refresh when one takes less than this share of it, and
# at most this share again to re-bound the open nodes with every form learned
# at the end of the time limit where the search has not finished: the open nodes' bound (FINAL_REFRESH_SHARE
# twice) and the probes of the floors below the target (`_probed_bound`), PROBE_REFRESHES refreshes' time for
# these, at most PROBE_SHARE of the limit in all; none where a refresh takes more than PROBE_LARGEST of the
# limit (1,000 units at 10 s: the search's last seconds find its better plans, BENCHMARKS.md)
PROBE_REFRESHES, PROBE_SHARE, PROBE_LARGEST = 2.5, 0.2, 0.05
PROBES = 12  # probes at most (each a refresh of the floors, more rounds of it than the search's)
PROBE_STEP = 1 / 3  # each probe's target: this share of the way from the bound proven to the least not proven


def _final_share(known: Forms, time_limit: float) -> float:
    """The seconds at the end of the time limit kept for the bound of a search that did not finish: the
    open nodes' and the probes of the floors below the target (`_probed_bound`), the search going on
    where they end early (none where a refresh is long for the limit: the search runs to the limit and
    the open nodes' bound follows, as without probes)."""
    if known.refresh_s > PROBE_LARGEST * time_limit:
        return 0.0
    return min(PROBE_SHARE * time_limit, 2 * FINAL_REFRESH_SHARE * time_limit + PROBE_REFRESHES * known.refresh_s)


def _probed_bound(known: Forms, low: float, high: float, deadline: float) -> float:
    """A bound of every split above `low` (one already proven) where the floors for targets below the
    search's `high` give one (Forms.probe: min(T, M(T)) holds for every T, and M(T) only rises as T
    falls): a search for the T where M(T) meets T (each probe's target a third of the way from the bound
    proven to the least target not proven, M below it), each probe's bound kept, the probes stopped at
    `deadline` (time.perf_counter()) or after PROBES. Where no form is known, or no probe ends in
    time, `low`."""
    if not len(known) or not math.isfinite(high):
        return low
    known.deadline = deadline
    best = max(low, 0.0)  # every duration is >= 0
    top = high
    for _ in range(PROBES):
        if top - best <= 1e-4 * top or time.perf_counter() + known.refresh_s > deadline:
            break
        T = best + PROBE_STEP * (top - best)
        probed = known.probe(T)
        if probed is None:  # past the deadline
            break
        best = max(best, probed)
        if probed < T:  # M(T) < T: the bound meets the target lower down
            top = T
    return best


def _open_bound(known: Forms, stack, target: float, refresh: bool, budget_s: float = math.inf) -> float:
    """The least bound of the nodes left open: each re-bounded with every form known now and (with
    `refresh`) the completions for the final target (a node's bound was computed when it was made, with
    fewer forms: the shallow ones, made first, are the weakest). Nodes go least bound first, so the
    walk stops at the first whose own bound reaches the least found (no later one can be below it)
    or after `budget_s` seconds (the next node's own bound then stands for the rest)."""
    if not stack:
        return math.inf
    if refresh:  # cheap (the caller's judgement): past the search's deadline, but given the budget
        known.deadline = time.perf_counter() + budget_s  # a refresh stopped there keeps the tables it had
        known.refresh(target)
    deadline = time.perf_counter() + budget_s
    every = slice(0, len(known))
    least = math.inf
    for bound, g, a, cuts, _ in sorted(stack, key=lambda node: node[0]):
        if least <= bound:
            break
        if time.perf_counter() > deadline:
            return min(least, bound)
        redone = float((form_prefix(known, every, cuts) + known.completion[:, g, a]).max(initial=-math.inf))
        redone = max(redone, float(known.least[g, a]))
        least = min(least, max(bound, redone))
    return least


def _split_bound(known: Forms, ends: Sequence[int]) -> float:
    """max_k form_k(split) for the complete split with these stage ends (+inf where a stage is no
    longer allowed: no split through it beats the target)."""
    total, a = np.array(known.constant, dtype=float), 0
    for g, e in enumerate(ends):
        if not known.terms.allowed[g][a, e]:
            return math.inf
        total += known.coefficients[g] @ known.terms.rows[g][:, a, e]
        a = e
    return float(total.max(initial=-math.inf))


def _simulate(profile: Profile, cuts: List[int], b: int, opts: CostOptions, redo: Optional[List[int]],
              known: Forms) -> Optional[Candidate]:
    """The split's cost (its longest path joins the forms); None if it does not fit (a scenario
    `evaluate` refuses raises its ValueError). `redo` None: the least recomputation each stage needs
    (planner.solve.recompute.recompute_for, whole units by time per byte freed)."""
    if redo is None:
        redo = recompute_for(profile, cuts, b, opts, exact=False)
        if redo is None:  # no recomputation makes it fit
            known.add(evaluate(profile, cuts, b, opts, []).critical_path)
            return None
    cost = evaluate(profile, cuts, b, opts, redo)
    known.add(cost.critical_path)
    return Candidate(cost.iteration_s, list(cuts), list(redo)) if cost.feasible else None
