"""Replicated stages (PipeDream-style): `planner solve --stages N --replicate`.

Plans are judged by the exact model (planner.cost.model: the simulation of the replicated lists).
Where the scenarios have at most ENUMERATED_PLANS plans, every one is simulated (the optimum, proven).
Beyond, they are chosen by an exact search over a closed form of it, the fill-drain form F, whose
optimum is then improved one move at a time under the exact model (`_polished`); its simulated time is
reported, and the certificate is the busy-time bound `busy_bound` (every device shares the micro-batches'
work; it holds for every replicated plan), a true but loose gap. The exact search's plan with one stage per device is a
candidate too: a replicated plan is chosen only when its simulated step is shorter. F (with T_g, A_g) and its
exact search: planner.solve.replica_search.

Recomputation. 'none' and 'all' fix T and A (exact; 'auto' without a cap is 'none', recomputing
only adds time). 'auto' under a cap: T' = T + the recomputation time that makes the range fit
holding h micro-batches, one table per h (planner.solve.chain_recompute): the greedy whole-unit
cover gives a plan (then each of its stages takes the exact cheapest cover), the fractional
knapsack a lower bound on every plan (F is monotone in each T'), and the gap between the two
searches is reported: 0 only when they meet.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from planner.cost.model import (candidate_micro_batch_sizes, compute_profile, evaluate, num_micro_batches,
                                rank_caps)
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.cost.ties import tied_weights
from planner.pipeline.schedule import ONE_STAGE_SCHEDULES
from planner.profile.profile import Profile
from planner.solve.diagnose import NoPlanInTime
from planner.solve.floors import OutOfTime
from planner.solve.replica_tables import (ReplicaSplit, ReplicaTables, TupleTables, replica_tuples,
                                          replicates_running_stats)
from planner.solve.solution import OPTIMALITY_GAP, Solution
from planner.solve.recompute import cheapest_recompute
from planner.solve.replica_polish import polished
from planner.solve.replica_refusals import infeasible, no_plan_in_time, too_many_tuples
from planner.solve.replica_search import ReplicaSearch


@dataclass
class _Found:
    """The best plan so far: its time without the per-step constant, shape, b, scenario, recomputation."""

    value: float
    split: ReplicaSplit
    b: int
    scenario: CostOptions
    recompute: List[int]


def check_replicable(profile: Profile, opts: CostOptions) -> None:
    """ValueError (saying what to do) unless replicated stages can be solved for these options."""
    if opts.schedule not in ONE_STAGE_SCHEDULES or opts.virtual_stages != 1:
        raise ValueError(f"--replicate needs --schedule 1f1b or gpipe (got {opts.schedule})")
    if opts.cluster is not None:
        raise ValueError("--replicate does not model a heterogeneous --cluster; drop one of them")
    if tied_weights(profile):  # frozen ones too: each rank holds one copy
        raise ValueError("--replicate does not model tied (shared) parameters; solve this profile without --replicate")


def _recompute_of(profile: Profile, tables: ReplicaTables, plan: ReplicaSplit, b: int, opts: CostOptions,
                  chosen: bool) -> List[int]:
    """The units a plan the search found recomputes: with `chosen` (auto, its tables bounding
    recomputation), the cheapest that fit; else every unit under 'all', none otherwise."""
    if chosen:
        return _cheapest_recompute(profile, tables, plan, b, rank_caps(opts, profile)[0])
    return list(range(profile.num_units)) if opts.recompute == "all" else []


def _cheapest_recompute(profile: Profile, tables: ReplicaTables, plan: ReplicaSplit, b: int, cap: float) -> List[int]:
    """Per stage of the plan, the cheapest recomputation that makes it fit (exact subsets up to
    EXACT_KNAPSACK_UNITS candidates, else greedy by time per byte)."""
    edges, reps, chosen = [0] + list(plan.boundaries) + [profile.num_units], plan.replicas, []
    for g, (a, e, r) in enumerate(zip(edges, edges[1:], reps)):
        need, held = tables.recompute_need(r, sum(reps[g:]), a, e, cap)
        if need > 0:
            try:
                found = cheapest_recompute(profile, b, a, e, need, held, 1.0, exact=True)
            except ValueError:  # too many candidate units for subsets
                found = cheapest_recompute(profile, b, a, e, need, held, 1.0, exact=False)
            chosen += found[1] if found is not None else []
    return sorted(chosen)


UNREPLICATED_SHARE = 0.25  # of the time limit: the exact search for one stage per device (first)
CLOSED_FORM_SHARE = 0.8  # of the time limit: the closed form's tables and searches end by then; the moves, the rest


def solve_replicated(profile: Profile, opts: CostOptions, scenarios: Optional[List[CostOptions]] = None,
                     time_limit: Optional[float] = None) -> Solution:
    """The best replicated plan: opts.pipeline_ranks (or each scenario's) = N devices per data-parallel
    replica, shared by S <= N stages: the fill-drain form's optimum (module docstring) for recompute
    none/all (and auto without a cap), its simulated time reported with the busy-time bound; under
    auto with a cap the plan uses greedy-then-exact per-stage recomputation and the bound comes
    from the fractional-knapsack tables, so the gap is 0 only when they meet. Raises ValueError for
    what it does not model, InfeasibleError when nothing fits.

    time_limit (seconds) bounds the whole solve: the plan with one stage per device gets the first
    UNREPLICATED_SHARE of it, the closed form's tables and searches stop by CLOSED_FORM_SHARE (a search
    cut short keeps the best plan it found; one stage on all N devices is then a candidate too) and the
    moves by the limit. The bound is the busy-time bound whether or not a search was complete, so the
    status is 'optimal' only where it meets the plan; NoPlanInTime where nothing was found in time and
    nothing proven not to fit."""
    started = time.perf_counter()
    deadline = None if time_limit is None else started + time_limit
    profile = compute_profile(profile, opts)  # activations and messages in the precision's compute dtype
    scenarios = scenarios or [opts]
    for scenario in scenarios:
        check_replicable(profile, scenario)
    enumerated = _enumerated(profile, opts, scenarios, deadline)
    if enumerated is not None:
        return dataclasses.replace(enumerated, seconds=time.perf_counter() - started)
    plain, complete = _unreplicated(profile, scenarios, None if time_limit is None else UNREPLICATED_SHARE * time_limit)
    closed_end = None if time_limit is None else started + CLOSED_FORM_SHARE * time_limit
    best, searched_all, unsearched_tuples = _closed_form(profile, scenarios, closed_end)
    complete = complete and searched_all
    if not searched_all:  # a search cut short: every device one stage's replica (data parallel) too
        best = _better(best, _one_stage(profile, scenarios, deadline))
    if best is None and plain is None:
        if unsearched_tuples:  # more time would not search them: say what would
            raise too_many_tuples(unsearched_tuples, MAX_TUPLES, opts.pipeline_ranks)
        if not complete:
            raise no_plan_in_time(time_limit)
        sizes = candidate_micro_batch_sizes(profile, opts.global_batch, opts)
        raise infeasible(profile, opts, opts.pipeline_ranks, sizes, deadline)
    if best is None or (plain is not None and plain.objective < best.value):
        chosen, b, redo, boundaries = plain.options, plain.micro_batch_size, plain.recompute, plain.boundaries
    else:
        chosen, b, redo, boundaries = _chosen(best.scenario, best.split), best.b, best.recompute, best.split.boundaries
    chosen, boundaries, cost = polished(profile, chosen, b, redo, list(boundaries), deadline)
    status, bound, gap = _certified(cost.iteration_s, _busy_bound(profile, scenarios))
    return Solution(boundaries=list(boundaries), micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                    cost=cost, status=status, objective=cost.iteration_s, bound=bound, gap=gap,
                    seconds=time.perf_counter() - started, method="replicas", backend="python", recompute=redo,
                    options=chosen)


def _certified(objective: float, bound: float) -> Tuple[str, float, float]:
    """(status, bound, gap) of a plan of this simulated step against a lower bound (the busy time's): 'optimal',
    with the bound the plan's own, where the gap is at most OPTIMALITY_GAP."""
    bound = min(bound, objective)
    gap = max(0.0, (objective - bound) / objective) if objective > 0 else 0.0
    if gap <= OPTIMALITY_GAP:
        return "optimal", objective, 0.0
    return "feasible", bound, gap


def _better(best: Optional[_Found], other: Optional[_Found]) -> Optional[_Found]:
    return other if best is None or (other is not None and other.value < best.value) else best


def _busy_bound(profile: Profile, scenarios: List[CostOptions]) -> float:
    """The least busy-time bound over the scenarios and their micro-batch sizes: it holds for every plan."""
    return min(busy_bound(profile, size, other) for other in scenarios
               for size in candidate_micro_batch_sizes(profile, other.global_batch, other))


def _closed_form(profile: Profile, scenarios: List[CostOptions], end: Optional[float]
                 ) -> Tuple[Optional[_Found], bool, int]:
    """The fill-drain form's searches (module docstring) over the scenarios and micro-batch sizes, each
    plan judged by the exact model: (the best plan that fits, whether every search was complete, the
    replica tuples left unsearched for being more than MAX_TUPLES: 0 where none was). Past
    `end` (time.perf_counter()) each search stops with the plan it has; every pass gets an equal share
    of the time left, and what one leaves goes to those after it."""
    jobs = []  # (scenario, b, auto, bounded)
    for scenario in scenarios:
        auto = scenario.recompute == "auto" and scenario.memory_cap is not None
        # under a cap the held messages (and 1f1b's held counts: suffix_warmups) depend on the stages
        # around a stage: bounded both ways
        bounded = scenario.memory_cap is not None
        if scenario.recompute == "auto" and not auto:  # no cap: recomputing only adds time
            scenario = scenario.with_(recompute="none")
        jobs += [(scenario, b, auto, bounded) for b in candidate_micro_batch_sizes(profile, scenario.global_batch,
                                                                                   scenario)]
    passes = len(jobs) + sum(1 for *_, bounded in jobs if bounded)  # the searches and the bounded ones' lower ones
    done = [0]

    def share() -> Optional[float]:
        """The deadline of the next pass: an equal share of the time left."""
        if end is None:
            return None
        now = time.perf_counter()
        return now + max(0.0, end - now) / max(1, passes - done[0])

    best: Optional[_Found] = None
    complete = True
    searched = []  # (scenario, b) under a cap
    for scenario, b, auto, bounded in jobs:
        searched += [(scenario, b, auto)] if bounded else []
        # under auto, the recomputation tables' bytes freed are an estimate (they leave out the
        # storages units share): when their plan does not fit, the plans that fit without
        # recomputing (the memory tables, an upper bound) are searched too
        for recompute_bound in ("upper", None) if auto else (None,):
            try:
                tables = ReplicaTables(profile, b, scenario, scenario.pipeline_ranks, recompute_bound, deadline=end)
            except OutOfTime:
                complete = False
                break
            search = ReplicaSearch(tables, best.value if best is not None else math.inf)
            search.run(share())
            complete = complete and not search.stopped
            if search.best is None:
                continue
            redo = _recompute_of(profile, tables, search.best, b, scenario, recompute_bound is not None)
            plain = evaluate(profile, search.best.boundaries, b, _chosen(scenario, search.best), redo)
            value = plain.iteration_s
            if plain.feasible and (best is None or value < best.value):
                best = _Found(value, search.best, b, scenario, redo)
            if plain.feasible:
                break
        done[0] += 1
    closed_bound = best.value if best is not None else math.inf
    possible = []  # the (scenario, b) whose relaxed tables have a plan, or were pruned before finding one
    for other, size, auto in searched:  # the lower-bound tables, pruned by the plan found
        try:
            relaxed = ReplicaTables(profile, size, other, other.pipeline_ranks, "lower" if auto else None,
                                    held_bound="lower", deadline=end)
        except OutOfTime:
            complete = False
            possible.append((other, size, auto))  # not proven to have no plan
            continue
        lower = ReplicaSearch(relaxed, closed_bound)
        lower.run(share())
        done[0] += 1
        complete = complete and not lower.stopped
        if lower.best is not None or math.isfinite(closed_bound) or lower.stopped:
            possible.append((other, size, auto))
        closed_bound = min(closed_bound, lower.U)
        if lower.best is not None:
            # the relaxation's plan may fit after all (the upper tables assumed the worst suffix and
            # messages): without auto it then beats every plan, time not depending on the held counts
            redo = _recompute_of(profile, relaxed, lower.best, size, other, auto)
            cost = evaluate(profile, lower.best.boundaries, size, _chosen(other, lower.best), redo)
            value = cost.iteration_s
            if cost.feasible and (best is None or value < best.value):
                best = _Found(value, lower.best, size, other, redo)
    unsearched = 0
    if best is None and possible:  # the bounds of the held counts and messages left no plan: exact, tuple by tuple
        best, tuples_done, unsearched = _by_tuple(profile, possible, end)
        complete = complete and tuples_done
    return best, complete, unsearched


def _one_stage(profile: Profile, scenarios: List[CostOptions], deadline: Optional[float]) -> Optional[_Found]:
    """One stage on all N devices (r = N: data parallelism inside the replica), the fastest that fits
    over the scenarios and micro-batch sizes (recomputing nothing, else, under auto, everything): the
    plan kept where a search was cut short before it found a better one (one simulation each)."""
    best: Optional[_Found] = None
    L = profile.num_units
    for scenario in scenarios:
        if scenario.recompute == "auto" and scenario.memory_cap is None:
            scenario = scenario.with_(recompute="none")
        N = scenario.pipeline_ranks
        split = ReplicaSplit([], [N])
        if replicates_running_stats(profile, [], (N,)):
            continue
        for b in candidate_micro_batch_sizes(profile, scenario.global_batch, scenario):
            if N > num_micro_batches(scenario, b):  # a replica per micro-batch at most
                continue
            sets = {"none": [[]], "all": [list(range(L))]}.get(scenario.recompute, [[], list(range(L))])
            for redo in sets:
                if deadline is not None and best is not None and time.perf_counter() > deadline:
                    return best
                cost = evaluate(profile, [], b, _chosen(scenario, split), redo)
                if cost.feasible:
                    best = _better(best, _Found(cost.iteration_s, split, b, scenario, redo))
                    break
    return best


ENUMERATED_PLANS = 2_000  # fewer plans than this in all: every one simulated (about 1 ms each), the optimum


def _enumerated(profile: Profile, opts: CostOptions, scenarios: List[CostOptions],
                deadline: Optional[float] = None) -> Optional[Solution]:
    """Where the scenarios have at most ENUMERATED_PLANS plans (stage count, replica tuple, split, micro-batch
    size, recomputation set), the best of all by the exact model (planner.solve.brute's enumeration): the
    fill-drain form's optimum is not always the simulation's (one small chain in seven); None beyond, and
    raises InfeasibleError where none fits. Past `deadline` (about 1 ms a plan), once a plan fits, the best
    simulated so far, with the busy-time bound."""
    from planner.solve.brute import replicated_plan_count, solve_brute_replicated

    plain = [s.with_(recompute="none") if s.recompute == "auto" and s.memory_cap is None else s for s in scenarios]
    counted = 0
    for scenario in plain:
        counted += replicated_plan_count(profile, scenario, ENUMERATED_PLANS - counted)
        if counted > ENUMERATED_PLANS:
            return None
    found, complete = [], True
    for scenario in plain:
        one = solve_brute_replicated(profile, scenario, deadline)
        if one is not None:
            complete = complete and one.status == "optimal"  # else stopped at the deadline
            found.append(one)
    if not found:  # as the search says it (`opts`: the options asked for)
        raise infeasible(profile, opts, opts.pipeline_ranks,
                          candidate_micro_batch_sizes(profile, opts.global_batch, opts))
    best = min(found, key=lambda f: f.objective)
    if not complete:  # the enumeration was stopped: the plan is the best simulated, the bound the busy time's
        status, bound, gap = _certified(best.objective, _busy_bound(profile, plain))
        best = dataclasses.replace(best, status=status, bound=bound, gap=gap)
    return dataclasses.replace(best, method="replicas", backend="enumeration")


MAX_TUPLES = 512  # replica tuples searched one by one (TupleTables) when the bounded tables find no plan


def _by_tuple(profile: Profile, searched, end: Optional[float] = None) -> Tuple[Optional[_Found], bool, int]:
    """The fill-drain form's optimum over every replica tuple with its exact memory (TupleTables),
    when the bounded tables found no plan under the cap: their held counts and messages are bounded
    over every tuple at once (ReplicaTables), so a plan that fits only just may lie between their
    two searches. None when nothing fits or there are more than MAX_TUPLES tuples (then none is
    searched: not a proof that none fits). `searched`: the (scenario, b) not proven to have no plan by
    the relaxed tables (the least held counts, no messages). Past `end` (time.perf_counter()) the best
    found so far; (the plan, whether every tuple was searched, the tuples left unsearched for being
    more than MAX_TUPLES)."""
    jobs = [(scenario, b, auto, reps) for scenario, b, auto in searched
            for S in range(1, min(scenario.pipeline_ranks, profile.num_units) + 1)
            for reps in replica_tuples(scenario.pipeline_ranks, S, min(scenario.pipeline_ranks,
                                                                       num_micro_batches(scenario, b)))]
    if len(jobs) > MAX_TUPLES:
        return None, False, len(jobs)
    best: Optional[_Found] = None
    closed = math.inf  # the least fill-drain value found: a tuple that cannot beat it is pruned
    for scenario, b, auto, reps in jobs:
        try:
            tables = TupleTables(profile, b, scenario, reps, deadline=end)
        except OutOfTime:
            return best, False, 0
        search = ReplicaSearch(tables, closed)
        search.run()
        if search.stopped:
            return best, False, 0
        if search.best is None:
            continue
        redo = _recompute_of(profile, tables, search.best, b, scenario, auto)
        cost = evaluate(profile, search.best.boundaries, b, _chosen(scenario, search.best), redo)
        if cost.feasible:  # (a plan that does not fit prunes nothing)
            closed = min(closed, search.U)
            if best is None or cost.iteration_s < best.value:
                best = _Found(cost.iteration_s, search.best, b, scenario, redo)
    return best, True, 0


def _unreplicated(profile: Profile, scenarios: List[CostOptions], time_limit: Optional[float] = None
                  ) -> Tuple[Optional[Solution], bool]:
    """The exact search's best plan with one stage per device (every r_g = 1), where N <= L: the
    replicated plan must beat it under the exact model to be chosen. (The plan, False where the search
    stopped at `time_limit` seconds before it found any, rather than proving none fits.)"""
    from planner.solve.search import search_scenarios

    usable = [s.with_(replicas=()) for s in scenarios if s.pipeline_ranks <= profile.num_units]
    if not usable:
        return None, True
    try:
        return search_scenarios(profile, usable, "ilp", time_limit=time_limit), True
    except NoPlanInTime:
        return None, False


def busy_bound(profile: Profile, b: int, opts: CostOptions) -> float:
    """A lower bound of every replicated plan's step under the exact model: N devices share the m
    micro-batches' work, and one micro-batch crosses every unit forward and back."""
    work = float(range_costs(profile, b).work_prefix(opts.recompute == "all")[-1])
    m = num_micro_batches(opts, b)
    return max(m * work / opts.pipeline_ranks, work) + opts.step_overhead_s


def _chosen(scenario: CostOptions, plan: ReplicaSplit) -> CostOptions:
    """The scenario as evaluated: S stages with their replicas (none listed when every r_g = 1)."""
    reps = tuple(plan.replicas)
    return scenario.with_(replicas=reps if max(reps) > 1 else ())  # sum(reps) = the scenario's ranks


__all__ = ["solve_replicated", "check_replicable"]
