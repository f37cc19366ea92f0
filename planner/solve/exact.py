"""The best split of one scenario under the exact model, with a proven bound.

The step time of a split is the longest path through its lists' graph (planner.cost.model); each
path is a linear form in the split's durations that bounds the step time of every split from
below. The program of planner.solve.ilp minimises T over the paths known so far, so its optimum is
a lower bound over all splits; the split it picks is simulated, and when its step time exceeds
T, the simulation's own longest path (and those of its neighbours) is added and the program solved
again. It stops when the picked split's simulated step equals T (that split is optimal), when no
split can beat the incumbent by more than `gap` (fixings or the program's cutoff say so), or at
the time limit (the program's bound is reported).

Forms to start from: the longest paths of the scenario's graph when one stage is much slower than
the others (at several ratios) or all are nearly equal, and those of the incumbent and of its
local search (planner.solve.local_search: every boundary moved by one unit while that improves the
simulated step; with several stages per device, runs of boundaries moved together).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from planner.cost.model import evaluate, num_micro_batches, rank_caps, rank_speeds, static_bytes, step_shape
from planner.cost.options import CostOptions
from planner.cost.ranges import prefix_sums, range_costs
from planner.cost.received import gap_row
from planner.cost.result import PathForm
from planner.cost.step import run_many, stage_in_flight, step_graph
from planner.cost.ties import later_uses_bytes, tie_copies, tied_weights
from planner.profile.profile import Profile
from planner.solve.branch import applies, branch_and_bound
from planner.solve.floors import OutOfTime, check_deadline
from planner.solve.flow_bound import ScenarioFlow
from planner.solve.ilp import Program, big_m_ms
from planner.solve.ilp_split import NoSplit
from planner.solve.local_search import candidate_of, local_search, neighbours, perturbations
from planner.solve.reach import stage_conditions, unit_ranges
from planner.solve.solution import Candidate

COARSE_GAP = 1e-3  # programs solved to this gap while the incumbent is further than it from the bound


@dataclass
class ScenarioOutcome:
    best: Optional[Candidate]
    bound_s: float  # no plan of the scenario is faster (seconds)
    optimal: bool  # the solver finished (bound_s is the optimum or the cutoff it proved)
    engine: str = "mip"  # what settled it: "mip" (the integer program) or "branch" (planner.solve.branch)
    forms: Set[PathForm] = field(default_factory=set)  # every path form known at the end: a later solve's seed


STRUCTURAL_SHARE = 0.1  # of a scenario's time limit, at most, for its structural forms (3 S + 8 simulations)
STRUCTURAL_BATCH = 16  # duration sets simulated at once (planner.cost.step.run_many), the deadline read between


def structural_forms(profile: Profile, b: int, opts: CostOptions, deadline: Optional[float] = None) -> Set[PathForm]:
    """Longest paths of the scenario's graph (no tied-weight collectives) under made-up durations:
    all nearly equal, and one stage slower than the rest at several ratios, simulated a batch at a
    time; past `deadline` (time.perf_counter()) those found (at 64 stages and 512 micro-batches a step's
    simulation takes 0.1 s alone, so 3 S + 8 of them may outlast a short limit)."""
    S = opts.num_stages
    m = num_micro_batches(opts, b)
    graph = step_graph(step_shape(opts, m))
    costs = range_costs(profile, b, opts.optimizer)
    ratio = float(costs.G[-1] / costs.F[-1]) if costs.F[-1] > 0 else 2.0
    forms: Set[PathForm] = set()

    def durations(forward: List[float]) -> Dict[Tuple, float]:
        value = {("forward", g): f for g, f in enumerate(forward)}
        value.update({("backward", g): f * ratio for g, f in enumerate(forward)})
        value.update({(part, g): f * ratio / 2 for g, f in enumerate(forward)
                      for part in ("backward_input", "backward_weight")})
        return value

    rng = random.Random(S * 1000 + m)
    shapes = [[1.0 + rng.uniform(-0.05, 0.05) for _ in range(S)] for _ in range(8)]
    shapes += [[1.0 if h == g else level for h in range(S)] for g in range(S) for level in (0.0, 0.5, 0.9)]
    for first in range(0, len(shapes), STRUCTURAL_BATCH):
        if forms and deadline is not None and time.perf_counter() > deadline:
            break
        for timeline in run_many(graph, [durations(f) for f in shapes[first:first + STRUCTURAL_BATCH]]):
            forms.add(PathForm(tuple(sorted(timeline.critical.items(), key=repr))))
    return forms


def _earlier(*deadlines: Optional[float]) -> Optional[float]:
    """The earliest of the deadlines given (None: none)."""
    return min((d for d in deadlines if d is not None), default=None)


def _fixings(profile: Profile, b: int, opts: CostOptions, forms: Set[PathForm], bound: float,
             deadline: Optional[float] = None):
    """Each unit's range of stages in a split faster than `bound` (planner.solve.reach); OutOfTime past
    `deadline` (O(S L^2) per form family at thousands of units)."""
    costs = range_costs(profile, b, opts.optimizer)
    S = opts.num_stages
    speeds = [rank_speeds(opts)[opts.rank_of_stage(g)] for g in range(S)]
    caps = [rank_caps(opts, profile)[opts.rank_of_stage(g)] for g in range(S)]
    memory = None
    if any(cap is not None for cap in caps):
        held = stage_in_flight(step_shape(opts, num_micro_batches(opts, b)))
        # a tie's later uses taken off: no rank holding a stage keeps less (planner.cost.ties)
        copies = tie_copies(tied_weights(profile), costs)
        later = [prefix_sums(later_uses_bytes(copies, profile.num_units, trained)) for trained in (False, True)]
        memory = (caps, held, static_bytes(costs.P - later[0], costs.T - later[1], opts, profile.dtype),
                  least_saved(costs, opts.recompute))
    forms_dicts = [f.count() for f in forms if not f.crossings]  # guarded paths do not hold for every split
    ok = stage_conditions(costs, S, speeds, forms_dicts if math.isfinite(bound) else [], bound,
                          recompute_all=opts.recompute == "all", memory=memory, deadline=deadline)
    return unit_ranges(ok)


def least_saved(costs, recompute: str) -> np.ndarray:
    """[a, e]: at most what stage [a, e) saves per micro-batch under `recompute` (planner.cost.ranges.saved; +inf
    where e <= a): per unit what it shares with the one before counted at most once (d, p, u or q as neither, it,
    that one or both are recomputed), at its start unit a d_a + first_a where negative (first_a: inputs received
    apart; every unit recomputed, q_a, never negative), every gap taken off (none recomputed), and a start
    receiving a storage apart its own terms' row (planner.cost.received)."""
    out, cuts = None, np.arange(costs.num_units + 1)
    for a, terms in ((None, costs), *costs.views.items()):
        share = terms.shares
        least = {"none": terms.s - terms.dup, "all": terms.inputs - share[:, 1, 1],
                 "auto": np.minimum(terms.s - np.maximum(share[:, 0, 0], share[:, 1, 0]),
                                    terms.inputs - np.maximum(share[:, 0, 1], share[:, 1, 1]))}[recompute]
        at_start = np.append(np.minimum(share[:, 1, 1] if recompute == "all" else terms.dup + terms.first, 0.0), 0.0)
        prefix = prefix_sums(least)
        if a is None:  # every range
            out = costs.matrix(prefix) + at_start[:, None]
            if recompute != "all" and terms.gaps:
                out = out - terms.gap_matrix()
            continue
        row = np.where(cuts > a, prefix - prefix[a], np.inf) + at_start[a]  # a start's own row alone
        out[a] = row if recompute == "all" else row - gap_row(terms, a)
    return out


RELAXED_SHARE, FITTING_SHARE = 0.6, 0.2  # of the time limit, for the two searches of `_without_recomputation`
CHOSEN_SHARE = 1.0  # of the time limit, for the splits' search bounding each split's recomputation


def _share_end(time_limit: Optional[float]) -> Optional[float]:
    """The deadline of the structural forms of a search given `time_limit` from now."""
    return None if time_limit is None else time.perf_counter() + STRUCTURAL_SHARE * time_limit


def _without_recomputation(profile: Profile, b: int, opts: CostOptions, best: Optional[Candidate],
                           time_limit: Optional[float], gap: float, target_s: Optional[float],
                           forms: Optional[Set[PathForm]] = None, flow: Optional[ScenarioFlow] = None):
    """What the branch and bound over splits (fast, no per-unit choices) tells a `--recompute auto`
    scenario under a cap, which the integer program solves next: (best plan, lower bound, settled).
    With one stage per device it searches the splits with each stage's least recomputation as a bound
    (planner.solve.recompute_bound) and each split's own (whole units) as its plan: settled where every
    split it reached met its bound. Otherwise, where only the per-device cap bounds memory, no plan
    beats the best split without the cap (recomputing only adds work): that search's bound is the
    scenario's, and its plan, when it fits, one of the scenario's (the optimum, when the search
    finished); or, where that plan does not fit, every split that fits without recomputing is a plan
    of the scenario: the best of them."""
    if applies(profile, opts, chosen=True):
        deadline = None if time_limit is None else time.perf_counter() + time_limit
        found = branch_and_bound(profile, b, opts, best, set(forms or ()), None if time_limit is None
                                 else CHOSEN_SHARE * time_limit, gap, target_s,
                                 improve=lambda split, until: local_search(profile, b, opts, split, forms or set(),
                                                                           _earlier(deadline, until)), flow=flow)
        if forms is not None:
            forms |= found.forms
        return found.best, found.bound_s, found.optimal
    plain = replace(opts, recompute="none")
    if not applies(profile, plain):
        return best, -math.inf, False
    bound, fitted = -math.inf, False
    view = opts.device_view
    if view is None or all(view.memory(i, None) is None for i in range(opts.pipeline_ranks)):
        free = replace(plain, memory_cap=None)
        # the incumbent's split without its recomputation: a plan there, no slower (a search needs one)
        start = None if best is None else \
            Candidate(evaluate(profile, best.boundaries, b, free, []).iteration_s, list(best.boundaries), [])
        relaxed = branch_and_bound(profile, b, free, start, structural_forms(profile, b, free, _share_end(time_limit)),
                                   None if time_limit is None else RELAXED_SHARE * time_limit, gap)
        bound = relaxed.bound_s
        if relaxed.best is not None:
            fits = evaluate(profile, relaxed.best.boundaries, b, opts, [])
            fitted = fits.feasible
            if fitted and (best is None or fits.iteration_s < best.iteration_s):
                best = Candidate(fits.iteration_s, list(relaxed.best.boundaries), [])
            if fitted and relaxed.optimal:  # the best split of all fits as it is
                return best, max(bound, best.iteration_s * (1 - gap)), True
    if not fitted:
        cutoff = min(best.iteration_s if best is not None else math.inf, math.inf if target_s is None else target_s)
        fitting = branch_and_bound(profile, b, plain, None, structural_forms(profile, b, plain, _share_end(time_limit)),
                                   None if time_limit is None else FITTING_SHARE * time_limit, gap,
                                   cutoff if math.isfinite(cutoff) else None)
        if fitting.best is not None and (best is None or fitting.best.iteration_s < best.iteration_s):
            best = fitting.best
    return best, bound, False


def solve_scenario(profile: Profile, b: int, opts: CostOptions, incumbent: Optional[Candidate],
                   time_limit: Optional[float], backend: str, gap: float = 1e-6,
                   forms: Optional[Set[PathForm]] = None, target_s: Optional[float] = None,
                   flow: Optional[ScenarioFlow] = None) -> ScenarioOutcome:
    """The best split of (scenario, b), or a proof that none is faster than `incumbent` (a plan of
    this scenario) or `target_s` (the best plan of any scenario) by more than `gap`; `flow` keeps the
    scenario's linear relaxation for its next solve (planner.solve.branch)."""
    started = time.perf_counter()
    forms = set(forms or ()) | structural_forms(profile, b, opts, None if time_limit is None
                                                else started + STRUCTURAL_SHARE * time_limit)
    best = incumbent
    if best is not None:
        forms.add(evaluate(profile, best.boundaries, b, opts, best.recompute).critical_path)
    bound = -math.inf

    def outcome(best_split, bound_s, optimal, engine="mip") -> ScenarioOutcome:
        return ScenarioOutcome(best_split, bound_s, optimal, engine, forms)

    deadline = None if time_limit is None else started + time_limit
    if applies(profile, opts):  # every term a stage's: branch and bound over the splits (planner.solve.branch)
        # the whole time: its floors bound a stopped search closer than the program would in what is left
        found = branch_and_bound(profile, b, opts, best, forms, time_limit, gap, target_s,
                                 improve=lambda split, until: local_search(profile, b, opts, split, forms,
                                                                           _earlier(deadline, until)), flow=flow)
        forms |= found.forms
        return outcome(found.best, found.bound_s, found.optimal, "branch")
    if opts.recompute == "auto":  # under a cap: the splits' search first, for a plan and a bound
        best, bound, settled = _without_recomputation(profile, b, opts, best, time_limit, gap, target_s, forms, flow)
        if settled:
            return outcome(best, bound, True, "branch")
        if time_limit is not None and time.perf_counter() - started >= time_limit:
            return outcome(best, bound, False, "branch")
    if best is not None:
        best = perturbations(profile, b, opts, best, forms, deadline)
    tight = False  # solve the next program to `gap` (a loose one found nothing new)
    excluded: List[Tuple[List[int], List[int]]] = []  # plans the program took as fitting that do not
    built_s = 0.0  # how long the last program took to build (a build cannot be stopped at the time limit)
    while True:
        cutoff = min(best.iteration_s if best is not None else math.inf,
                     target_s if target_s is not None else math.inf) * (1 - gap)
        if (best is not None or target_s is not None) and time_limit is not None and \
                time.perf_counter() - started + built_s >= time_limit:  # no time to build and solve another
            return outcome(best, bound, False)
        # with a plan in hand (this scenario's or another's), the fixings and the program's build stop at
        # the limit (a search without one needs the program)
        late = deadline if best is not None or target_s is not None else None
        try:
            ranges = _fixings(profile, b, opts, forms, cutoff - opts.step_overhead_s, late)
        except OutOfTime:
            return outcome(best, bound, False)
        if ranges is None or any(lo > hi for lo, hi in zip(*ranges)):
            return outcome(best, cutoff, True)
        building = time.perf_counter()
        try:
            program = Program(profile, b, opts, *ranges, deadline=late)
            for form in forms:
                check_deadline(late)
                program.add_form(form, big_m_ms(profile, b, opts, form))
            for plan in excluded:
                program.exclude(*plan)
        except NoSplit:
            return outcome(best, cutoff, True)
        except OutOfTime:
            return outcome(best, bound, False)
        built_s = time.perf_counter() - building
        remaining = None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - started))
        # far from the incumbent, a loose program finds good splits (tightening the fixings) sooner
        loose = not tight and gap < COARSE_GAP and best is not None and \
            (best.iteration_s - max(bound, 0.0)) > COARSE_GAP * best.iteration_s
        result = program.solve(cutoff if math.isfinite(cutoff) else None, remaining, backend,
                               gap=COARSE_GAP / 4 if loose else gap / 4)
        if not result.ran:
            if best is None:
                raise RuntimeError(f"the {backend} solver returned no plan (it crashed, or ran past its time limit and "
                                   "was stopped); give it more time or enable the warm start")
            return outcome(best, bound, False)
        if not result.below_cutoff:
            proven = result.optimal and math.isfinite(cutoff)
            return outcome(best, max(bound, cutoff if proven else result.bound_s), proven)
        bound = max(bound, result.bound_s)
        before = len(forms)
        found = candidate_of(profile, result.boundaries, b, opts, result.recompute, forms)
        if found is not None and (best is None or found.iteration_s < best.iteration_s):
            best = found
        if found is not None and result.optimal and not loose and \
                found.iteration_s * (1 - gap) <= max(bound, result.bound_s):
            return outcome(best, max(bound, result.bound_s), True)
        for moved in neighbours(result.boundaries, profile.num_units):
            near = candidate_of(profile, moved, b, opts, None if opts.recompute == "auto" else result.recompute, forms)
            if near is not None and (best is None or near.iteration_s < best.iteration_s):
                best = near
        if len(forms) == before and loose:
            tight = True
            continue
        if found is None:  # the program took for a plan one `evaluate` rejects (a memory term its rows miss)
            excluded.append((list(result.boundaries), list(result.recompute)))
        if len(forms) == before and found is not None:
            # the split's own path was known and still the program undervalues it: numerical noise
            return outcome(best, max(bound, min(result.value_s, best.iteration_s)), result.optimal)
        if time_limit is not None and time.perf_counter() - started >= time_limit:
            return outcome(best, bound, False)
