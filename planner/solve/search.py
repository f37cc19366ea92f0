"""The outer search: every scenario (pipeline depth p, data-parallel d, schedule, v, micro-batch b),
each solved under the exact model (planner.solve.exact), with the global certificate.

The decisions that change the shape of the lists (p, d, schedule, v, b) are enumerated; the
boundaries and recomputation are solved inside each scenario. Each scenario first gets a good plan
fast (the fill-drain chain optimum and a balanced split, simulated, then improved by local search)
and a lower bound that holds for every split under the exact model (planner.solve.scenario_bound).
Scenarios are solved from the most promising; one whose bound is not below the best plan found is skipped, and the global bound is the minimum over scenarios of
their proven bounds (a skipped scenario contributes its bound), so the reported gap is a true gap.
Under a time limit the first scenario solved gets half the time left and each later one at least an
equal share of it; time they leave goes to the unsettled ones again (a scenario keeps the larger of
its proven bounds).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from planner.cost.memory import SHARDS
from planner.cost.model import candidate_micro_batch_sizes, evaluate, rank_caps
from planner.cost.options import CostOptions
from planner.pipeline.schedule import schedule_virtual_stages
from planner.cost.ranges import range_costs
from planner.profile.profile import Profile
from planner.solve.diagnose import NoPlanInTime, memory_matrices, min_max_partition
from planner.solve.exact import solve_scenario
from planner.solve.flow_bound import FlowTimes, ScenarioFlow
from planner.solve.local_search import candidate_of, local_search
from planner.solve.floors import OutOfTime, check_deadline
from planner.solve.scenario_bound import scenario_lower_bound
from planner.solve.solution import OPTIMALITY_GAP, Solution, Candidate, scenario_gap

RESOLVE_S = 0.5  # time left (seconds) worth solving an unsettled scenario again
STARTS_SHARE = 0.3  # of the time limit, at most, for the scenarios' starting plans (heuristic_plan)
VIRTUAL_STAGES = (2, 3, 4)  # v compared when a chunked schedule is chosen without --virtual-stages


def device_splits(devices: int, global_batch: int) -> List[Tuple[int, int]]:
    """(p, d): the pipeline depths and data-parallel degrees with p d = `devices`, d dividing the
    global batch (each replica takes an equal share), d ascending."""
    return [(devices // d, d) for d in range(1, devices + 1) if devices % d == 0 and global_batch % d == 0]


def expand_scenarios(opts: CostOptions, num_units: int, devices: Optional[int] = None,
                     schedules: Optional[Sequence[str]] = None, virtual_stages: Optional[int] = None
                     ) -> List[CostOptions]:
    """Concrete options: each schedule (interleaved/bfs with v = virtual_stages, default the
    options' own, or each of VIRTUAL_STAGES when several schedules are compared, else 2; zb-v with
    its 2, the others with 1) and,
    given `devices` N, each p x d = N; under shard 'auto', each of planner.cost.memory's shardings
    (only 'none' where d = 1: one holder shards nothing)."""
    if virtual_stages is not None:
        chunk_options = [virtual_stages]
    elif opts.virtual_stages > 1:
        chunk_options = [opts.virtual_stages]
    else:
        chunk_options = list(VIRTUAL_STAGES) if schedules and len(schedules) > 1 else [2]
    schedules = list(schedules) if schedules else [opts.schedule]
    pairs = ([(opts.pipeline_ranks, opts.data_parallel)] if devices is None
             else device_splits(devices, opts.global_batch))
    out = []
    for p, d in pairs:
        shards = [opts.shard] if opts.shard != "auto" else list(SHARDS) if d > 1 else ["none"]
        for schedule in schedules:
            fixed = schedule_virtual_stages(schedule)
            for v in (chunk_options if fixed is None else [fixed]):
                if p * v <= num_units:
                    out += [opts.with_(pipeline_ranks=p, data_parallel=d, schedule=schedule, virtual_stages=v,
                                       shard=shard) for shard in shards]
    return out


@dataclass
class _Scenario:
    opts: CostOptions
    b: int
    start: Optional[Candidate]  # a good plan found fast (None: none found)
    lower_bound: float  # on every plan of the scenario (seconds)


def _balanced_split(profile: Profile, b: int, opts: CostOptions, deadline: Optional[float] = None
                    ) -> Optional[List[int]]:
    """The split whose largest stage work is least (OutOfTime past `deadline`)."""
    costs = range_costs(profile, b)
    check_deadline(deadline)
    table = costs.matrix(costs.F + costs.G)
    return min_max_partition(profile.num_units, opts.num_stages, lambda g: table, deadline)[1]


def _even_split(profile: Profile, b: int, opts: CostOptions) -> List[int]:
    """Each stage about 1/S of the forward and backward work (O(L): where the prefix sums cross k/S
    of the total), one unit at least each."""
    costs = range_costs(profile, b)
    work = costs.F + costs.G
    L, S = profile.num_units, opts.num_stages
    cuts = np.searchsorted(work, work[-1] * np.arange(1, S) / S)
    boundaries: List[int] = []
    for k, cut in enumerate(cuts):  # strictly increasing, leaving a unit for every later stage
        boundaries.append(int(min(max(cut, boundaries[-1] + 1 if boundaries else 1), L - (S - 1 - k))))
    return boundaries


def _starts(profile: Profile, b: int, opts: CostOptions, deadline: Optional[float] = None) -> List[List[int]]:
    """Splits worth simulating first: the fill-drain chain optimum (v = 1, no tied weights; the best
    the chain search has at `deadline`), a balanced split and, under memory caps, the split with the
    least peak memory; past `deadline` (time.perf_counter()) those found, at least an even split of
    the work (at thousands of units each of the others takes seconds)."""
    from planner.solve.dp import chain_start

    starts = []
    fast = chain_start(profile, b, opts, deadline)
    if fast is not None:
        starts.append(list(fast.boundaries))
    try:
        balanced = _balanced_split(profile, b, opts, deadline)
        if balanced is not None:
            starts.append(balanced)
        if opts.virtual_stages == 1 and any(cap is not None for cap in rank_caps(opts, profile)):
            least_memory = min_max_partition(profile.num_units, opts.num_stages, memory_matrices(profile, b, opts),
                                             deadline)[1]
            if least_memory is not None:
                starts.append(least_memory)
    except OutOfTime:
        pass
    if not starts and opts.num_stages <= profile.num_units:
        starts.append(_even_split(profile, b, opts))
    return starts


def heuristic_plan(profile: Profile, b: int, opts: CostOptions, forms=None,
                   deadline: Optional[float] = None) -> Optional[Candidate]:
    """A good feasible plan fast: the best simulated start, improved by local search (both cut
    short at `deadline`, time.perf_counter())."""
    forms = set() if forms is None else forms
    best: Optional[Candidate] = None
    for boundaries in _starts(profile, b, opts, deadline):
        if best is not None and deadline is not None and time.perf_counter() >= deadline:
            break
        found = candidate_of(profile, boundaries, b, opts, None, forms)
        if found is not None and (best is None or found.iteration_s < best.iteration_s):
            best = found
    return local_search(profile, b, opts, best, forms, deadline) if best is not None else None


def search_scenarios(profile: Profile, scenarios: List[CostOptions], method: str, time_limit: Optional[float] = None,
                     backend: str = "highs", warm_start: bool = True,
                     gap: float = OPTIMALITY_GAP, progress: Optional[Callable[[str], None]] = None) -> Optional[Solution]:
    """Best plan over the scenarios by `method` ('ilp': exact with a certificate, the search done
    once no plan can be faster than the one found by more than `gap`; 'dp': the fast heuristic
    alone, with the scenarios' lower bounds as its bound, or the exact search where the heuristic
    finds no plan that fits); None when nothing fits. `progress` is told, in one line each, the best
    plan and the bound over every scenario whenever a scenario's search moved them."""
    started = time.perf_counter()
    said = [None]  # the (plan, bound) last told

    def tell() -> None:
        if progress is None:
            return
        bound = min([proven[i][0] if i in proven else it.lower_bound for i, it in enumerate(items)], default=math.inf)
        plan = best[0].iteration_s if best is not None else math.inf
        if said[0] == (plan, bound):
            return
        said[0] = (plan, bound)
        where = "" if best is None else \
            f" ({_layout(best[1].opts)}, micro-batch {best[1].b})"
        gap_text = f", gap {100 * (plan - bound) / plan:.2f} %" if math.isfinite(plan) and math.isfinite(bound) else ""
        progress(f"{time.perf_counter() - started:6.1f} s  best {_ms(plan)}{where}, bound {_ms(bound)}{gap_text}")
    # the starts take at most a share of the time limit (the chain search is slow on large profiles)
    deadline = None if time_limit is None else started + STARTS_SHARE * time_limit
    limit = None if time_limit is None else started + time_limit
    # the bounds may take the whole limit (a weak one makes the gap, however long the search ran); one of
    # +inf proves the scenario has no plan (no split fits its devices)
    rated = [(k, opts, b, scenario_lower_bound(profile, b, opts, limit)) for opts in scenarios
             for k, b in enumerate(candidate_micro_batch_sizes(profile, opts.global_batch, opts))]
    if progress is not None:
        empty = sum(1 for *_, lower in rated if lower == math.inf)
        progress(f"{time.perf_counter() - started:6.1f} s  {len(rated)} scenarios (layout x micro-batch size)"
                 + (f", {empty} with no split that fits" if empty else "") + "; starting plans next")
    items, started_one = [], False
    # the starts layout by layout for each micro-batch size in turn (the starts' share of the time may not
    # reach every size of the first layouts: each layout gets its first before any its second), none where
    # no split fits; past the deadline only until one scenario has a plan: each start is a simulation of
    # its lists
    # (several stages per device: each what is left of it shared among the scenarios still to start, as
    # their local search's chain shifts, planner.solve.local_search._shifted, could take it all)
    ordered = sorted(rated, key=lambda item: item[0])
    for index, (_, opts, b, lower) in enumerate(ordered):
        late = started_one and deadline is not None and time.perf_counter() >= deadline
        own = deadline
        if deadline is not None and opts.virtual_stages > 1:
            now = time.perf_counter()
            own = now + max(0.0, deadline - now) / (len(ordered) - index)
        start = heuristic_plan(profile, b, opts, deadline=own) \
            if (warm_start or method == "dp") and not late and lower < math.inf else None
        started_one = started_one or start is not None
        items.append(_Scenario(opts, b, start, lower))
    items.sort(key=lambda it: (it.start.iteration_s if it.start else math.inf, it.lower_bound))
    best = None  # (Candidate, _Scenario)
    for it in items:
        if it.start is not None and (best is None or it.start.iteration_s < best[0].iteration_s):
            best = (it.start, it)
    proven = {}  # index of a scenario solved -> (its proven bound, settled, its best plan)
    tell()
    if method == "dp" and best is not None:  # with no plan found, the exact search decides feasibility
        bound = min((it.lower_bound for it in items), default=math.inf)
        return _solution(profile, best, bound, False, started, "dp", "python", OPTIMALITY_GAP)  # no search
    skipped, engines = math.inf, set()
    learned = {}  # index of a scenario solved -> the path forms its solve knew at the end
    flow_times, flows = FlowTimes(), {}  # the linear relaxations' times, and each scenario's (index ->)
    skip = scenario_gap(gap) if gap > OPTIMALITY_GAP else 1e-12  # no plan of a skipped one beats the best by more

    def settle(index: int, start: Optional[Candidate], seconds: Optional[float], forms=None):
        """Scenario `index` solved from `start` for `seconds`: its plan may become the best, and the
        bound it proves joins what it had (each holds, so it keeps the larger)."""
        nonlocal best
        it = items[index]
        before = proven[index][0] if index in proven else it.lower_bound
        outcome = solve_scenario(profile, it.b, it.opts, start, seconds, backend, gap=scenario_gap(gap), forms=forms,
                                 target_s=best[0].iteration_s if best is not None and warm_start else None,
                                 flow=flows.setdefault(index, ScenarioFlow(flow_times)))
        engines.add(outcome.engine)
        if outcome.best is not None and (best is None or outcome.best.iteration_s < best[0].iteration_s):
            best = (outcome.best, it)
        proven[index] = (max(before, outcome.bound_s), outcome.optimal, outcome.best or start)
        learned[index] = outcome.forms
        tell()
        return outcome

    for index, it in enumerate(items):
        if it.lower_bound == math.inf:  # proven to have no plan (no split fits its devices)
            continue
        out_of_time = time_limit is not None and time.perf_counter() - started >= time_limit
        if best is not None and (out_of_time or it.lower_bound >= best[0].iteration_s * (1 - skip)):
            skipped = min(skipped, it.lower_bound)  # its bound stands for it
            continue
        # the most promising scenario half the time left, each later one an equal share of it (the
        # bound is the least of theirs); what one does not use goes to those after it
        left = None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - started))
        settle(index, it.start, None if left is None else max(left / 2, left / (len(items) - index)))
    # time left over (scenarios settled early): the unsettled ones again, from their best plans, the
    # least bound first; each bound proven holds, so a scenario keeps the larger. With no plan yet
    # too: a scenario stopped at its share with nothing is no answer while the limit has time left
    while time_limit is not None:
        left = time_limit - (time.perf_counter() - started)
        open_ones = [index for index, (bound_s, settled, _) in proven.items()
                     if not settled and bound_s < math.inf]  # +inf: proven to have no plan
        if left < RESOLVE_S or not open_ones:
            break
        index = min(open_ones, key=lambda i: proven[i][0])
        before, _, start = proven[index]
        outcome = settle(index, start, left, learned[index])
        if not outcome.optimal and outcome.bound_s <= before:
            break  # more time did not help it
    bound = min([skipped] + [b for b, _, _ in proven.values()])
    # a bound of +inf proves the scenario has no plan (an infeasible program with no cutoff: not 'optimal')
    all_proven = all(settled or b == math.inf for b, settled, _ in proven.values())
    # stopped with nothing, not a proof: at the limit, or a scenario at its share of it (time left over)
    if best is None and not all_proven and time_limit is not None:
        raise NoPlanInTime(f"no plan found within the time limit of {time_limit:g} s, and none proven impossible "
                           "either; allow more time (--time-limit)")
    if best is None:
        return None
    # the backend names the integer program's solver; scenarios settled by branch and bound ran none
    used = backend if "mip" in engines or not engines else "branch-and-bound"
    return _solution(profile, best, bound, all_proven, started, "ilp", used, gap)


def _layout(opts: CostOptions) -> str:
    """p x d schedule (v) of a scenario, as the progress lines name it."""
    v = f" v={opts.virtual_stages}" if opts.virtual_stages > 1 else ""
    return f"{opts.pipeline_ranks} x {opts.data_parallel} {opts.schedule}{v}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if math.isfinite(seconds) else "none"


def _solution(profile: Profile, best, bound: float, proven: bool, started: float, method: str,
              backend: str, requested_gap: float) -> Solution:
    candidate, it = best
    cost = evaluate(profile, candidate.boundaries, it.b, it.opts, candidate.recompute)
    iteration = cost.iteration_s
    if abs(iteration - candidate.iteration_s) > 1e-9 * max(1.0, iteration):
        raise AssertionError("the solver's objective differs from the simulation of its plan")
    bound = min(bound, iteration)
    gap = max(0.0, (iteration - bound) / iteration) if iteration > 0 else 0.0
    if proven and gap <= OPTIMALITY_GAP:
        bound, gap = iteration, 0.0
    status = "optimal" if gap <= OPTIMALITY_GAP else "feasible"
    return Solution(boundaries=list(candidate.boundaries), micro_batch_size=it.b,
                    num_micro_batches=cost.num_micro_batches, cost=cost, status=status, objective=iteration,
                    bound=bound, gap=gap, seconds=time.perf_counter() - started, method=method, backend=backend,
                    recompute=list(candidate.recompute), options=it.opts,
                    requested_gap=max(requested_gap, OPTIMALITY_GAP))
