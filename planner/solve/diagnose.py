"""Why no plan exists, said so the user can fix it; and the exact min-max partition DP behind it.

The DP. For a stage cost C_s(a, e) of placing units [a, e) as stage s (infinite when not
allowed), the best split into S contiguous non-empty stages minimising max_s C_s is

    best_0(e) = C_0(0, e)
    best_s(e) = min_{a < e} max(best_{s-1}(a), C_s(a, e))          s = 1 .. S-1

with the answer best_{S-1}(L). It is exact for any stage cost that depends only on (s, a, e),
which is the case for both stage memory M_s (through inflight_s) and stage time T_s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from planner.cost.model import candidate_micro_batch_sizes, evaluate, fixed_bytes
from planner.cost.options import CostOptions
from planner.cost.stage_memory import StageMemory
from planner.pipeline.schedule import MAX_MICRO_BATCHES, MULTI_STAGE_SCHEDULES, schedule_virtual_stages
from planner.profile.profile import Profile
from planner.sizes import format_bytes
from planner.solve.floors import check_deadline


class InfeasibleError(Exception):
    """No plan satisfies the request. The message (one or two lines) says how to fix it."""

    def __init__(self, message: str, min_memory_bytes: Optional[float] = None,
                 min_stages: Optional[int] = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes  # smallest memory per device that fits S stages
        self.min_stages = min_stages  # smallest stage count fitting the given cap, if any


class NoPlanInTime(Exception):
    """The search stopped before it found a plan, and did not prove that none fits either (an
    InfeasibleError says that): at its time limit (more time may find one), or, under --replicate, at
    more replica tuples than it searches one by one (the message says what to do)."""


StageCostMatrix = Callable[[int], np.ndarray]  # s -> (L+1) x (L+1) matrix C_s[a, e], inf where e <= a


def min_max_partition(num_units: int, num_stages: int, stage_cost: StageCostMatrix,
                      deadline: Optional[float] = None) -> Tuple[float, Optional[List[int]]]:
    """Exact min over contiguous splits of max_s C_s(a_s, e_s): (value, boundaries) or (inf, None).
    O(S L^2): OutOfTime past `deadline` (time.perf_counter()), checked per stage."""
    L, S = num_units, num_stages
    if not 1 <= S <= L:
        return math.inf, None
    best = np.array(stage_cost(0)[0, :], dtype=float)  # best_0(e)
    choices: List[np.ndarray] = []
    for s in range(1, S):
        check_deadline(deadline)
        candidates = np.maximum(best[:, None], stage_cost(s))  # [a, e]
        arg = np.argmin(candidates, axis=0)
        best = candidates[arg, np.arange(L + 1)]
        choices.append(arg)
    value = float(best[L])
    if not math.isfinite(value):
        return math.inf, None
    boundaries: List[int] = []
    e = L
    for arg in reversed(choices):
        e = int(arg[e])
        boundaries.append(e)
    return value, sorted(boundaries)


def memory_matrices(profile: Profile, b: int, opts: CostOptions) -> StageCostMatrix:
    """s -> M_s[a, e]: stage s's memory holding units [a, e) (one stage per rank, every unit
    recomputed under --recompute all, none otherwise): planner.cost.stage_memory's (one copy of a
    tied weight per stage), plus the fixed bytes every device holds."""
    memory = StageMemory(profile, b, opts, recompute_all=opts.recompute == "all")
    fixed = fixed_bytes(profile, opts)
    return lambda s: memory.matrix(s) + fixed


@dataclass
class MemoryFloor:
    """The split with the least peak stage memory, over all candidate micro-batch sizes."""

    memory_bytes: float
    micro_batch_size: int
    boundaries: List[int]


def min_memory_plan(profile: Profile, opts: CostOptions) -> Optional[MemoryFloor]:
    """Smallest memory per device that fits S stages: min over b, splits of max_s M_s (exact)."""
    best: Optional[MemoryFloor] = None
    for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
        value, boundaries = min_max_partition(profile.num_units, opts.num_stages, memory_matrices(profile, b, opts))
        if boundaries is None:
            continue
        # Report exactly what the cost model computes for this split (the DP sums in another order).
        peak = max(evaluate(profile, boundaries, b, opts, _recomputed(profile, opts)).device_memory)
        if best is None or peak < best.memory_bytes:
            best = MemoryFloor(peak, b, boundaries)
    return best


def _readings(opts: CostOptions) -> List[CostOptions]:
    """The recomputation the floors count: the plan's, or under auto none and every unit (a choice of
    some units may fit in less than both: what is reported from them is hedged)."""
    return [opts] if opts.recompute != "auto" else [opts.with_(recompute=r) for r in ("none", "all")]


def least_memory_plan(profile: Profile, opts: CostOptions) -> Optional[Tuple[MemoryFloor, CostOptions]]:
    """min_memory_plan of the least of `_readings`, and the reading."""
    floors = [(floor, reading) for reading in _readings(opts) for floor in [min_memory_plan(profile, reading)] if floor]
    return min(floors, key=lambda pair: pair[0].memory_bytes) if floors else None


def _recomputed(profile: Profile, opts: CostOptions) -> List[int]:
    """The units the plan recomputes whatever its split: all under --recompute all, else none (called
    under auto directly, the floor is counted without recomputation: an upper reading of it)."""
    return list(range(profile.num_units)) if opts.recompute == "all" else []


def smallest_fitting_stages(profile: Profile, opts: CostOptions) -> Optional[int]:
    """The least S' <= L for which some split and candidate b fit opts.memory_cap, or None.

    Counted from the last stage, a middle stage S'-1-j holds what stage L-1-j of the L-stage lists
    holds whatever S' is (min(j + 1, m) micro-batches under 1F1B, m under GPipe, and their
    messages), so one backward DP answers every S' at once:

        R_0(a) = [M^(0)(a, L) <= cap]
        R_j(a) = OR_{e > a} [M^(j)(a, e) <= cap] AND R_{j-1}(e)      (units [a, L) in j + 1 stages)

    A first stage holds its own pattern (no received activations, but its sends' buffers at other
    moments), so S' = j + 1 fits iff OR_e [F^(j)(0, e) <= cap] AND R_{j-1}(e), with F^(j) the first
    stage of the (j + 1)-stage lists. Cost O(L^3) per b, vectorised over (a, e).
    """
    L, cap = profile.num_units, opts.memory_cap
    sizes = candidate_micro_batch_sizes(profile, opts.global_batch, opts)
    if cap is None:
        return 1 if sizes else None
    lists = lambda stages: opts.with_(pipeline_ranks=stages, cluster=None, placement=None)  # noqa: E731
    middles = [memory_matrices(profile, b, lists(L)) for b in sizes]  # M^(j): stage L-1-j
    fixed = fixed_bytes(profile, opts)
    recompute_all = opts.recompute == "all"
    reach = [None] * len(sizes)
    for j in range(L):
        if j > 0 and not any(r.any() for r in reach):
            return None  # no stage after the first fits anywhere: nor with more stages (R_j needs R_j-1)
        for i, b in enumerate(sizes):
            if j > 0 and not reach[i].any():
                continue
            first = StageMemory(profile, b, lists(j + 1), recompute_all).row(0, 0) + fixed <= cap
            if (first[L] if j == 0 else np.any(first & reach[i])):
                return j + 1
            fits = middles[i](L - 1 - j) <= cap  # [a, e]
            reach[i] = fits[:, L].copy() if j == 0 else np.any(fits & reach[i][None, :], axis=1)
    return None


def _units_text(profile: Profile, first: int, end: int) -> str:
    names = profile.units
    if end - first == 1:
        return f"unit {first} {names[first].name!r}"
    return f"units {first}..{end - 1} {names[first].name!r}..{names[end - 1].name!r}"


def diagnose_stages(stages: int, num_units: int) -> str:
    return (f"{stages} stages requested but the profile has only {num_units} units; "
            f"use at most {num_units} stages, or profile the model with finer partition units")


def diagnose(profile: Profile, opts: CostOptions, more: str = "more stages") -> str:
    """Explain why no plan exists for (profile, opts), or say that one does; `more`: the fix that
    adds devices as the request can ("more devices" where --devices chose p x d)."""
    L, S, G = profile.num_units, opts.pipeline_ranks, opts.global_batch  # S: what --stages asked
    if S > L:
        return diagnose_stages(S, L)
    if opts.num_stages > L:  # each rank holds several stages (interleaved, bfs, zb-v)
        return no_layout_message(L, opts, None, [opts.schedule])
    if not candidate_micro_batch_sizes(profile, G, opts):
        return no_micro_batch_size(profile, opts)
    if opts.virtual_stages > 1 or opts.device_view is not None or opts.data_parallel > 1:
        fixes = ["allow more memory", more] + \
            (["fewer --virtual-stages"] if opts.schedule in MULTI_STAGE_SCHEDULES else []) + \
            (["--recompute auto"] if opts.recompute != "auto" else []) + \
            (["--shard auto (ZeRO over the replicas)"] if opts.data_parallel > 1 and opts.shard == "none" else [])
        return (f"no plan fits the memory per device with {S} ranks x {opts.virtual_stages} stages, schedule "
                f"{opts.schedule}, data-parallel {opts.data_parallel}; fix: {', '.join(fixes[:-1])} or {fixes[-1]}")
    least = least_memory_plan(profile, opts)
    cap = opts.memory_cap
    if least is None:  # cannot happen when S <= L, kept for safety
        return f"no split of {L} units into {S} stages exists"
    floor, counted = least
    if cap is None or floor.memory_bytes <= cap:
        return f"a plan fits: the smallest memory per device for {S} stages is {format_bytes(floor.memory_bytes)}"
    cost = evaluate(profile, floor.boundaries, floor.micro_batch_size, counted, _recomputed(profile, counted))
    worst = max(range(S), key=lambda s: cost.device_memory[s])
    stage = cost.stages[worst]
    how = "" if counted is opts else (" when recomputing every unit" if counted.recompute == "all" else
                                       " without recomputation")
    first_line = (f"no plan fits {format_bytes(cap)} per device with {S} stage{'s' if S != 1 else ''}: even the split that needs "
                  f"the least memory{how} (micro-batch size {floor.micro_batch_size}) puts "
                  f"{format_bytes(cost.device_memory[worst])} on stage {worst} "
                  f"({_units_text(profile, stage.first_unit, stage.end_unit)}), "
                  f"{format_bytes(cost.device_memory[worst] - cap)} over the cap")
    fitting = [n for n in (smallest_fitting_stages(profile, reading) for reading in _readings(opts)) if n is not None]
    need = ("at least " if opts.recompute != "auto" else "") + \
        f"{format_bytes(floor.memory_bytes)} ({floor.memory_bytes:.0f} bytes) per device" + \
        (f" (what fits{how}; recomputing some units may fit in less)" if opts.recompute == "auto" else "")
    counted_as = " without recomputation or recomputing every unit" if opts.recompute == "auto" else ""
    fix = (f"fix: allow {need}"
           + (f", or use {min(fitting)} stages" if fitting else
              f"; no number of stages up to {L} fits under {format_bytes(cap)}{counted_as}"))
    return first_line + "; " + fix  # one line: the cause and the fix


def no_micro_batch_size(profile: Profile, opts: CostOptions) -> str:
    """Why no profiled micro-batch size b gives a plan: none divides G / d, every one that does
    makes more than MAX_MICRO_BATCHES micro-batches, or (interleaved) no m = G / (d b) is a
    multiple of the p ranks."""
    G, d, p = opts.global_batch, opts.data_parallel, opts.pipeline_ranks
    sizes = sorted(int(b) for b in profile.micro_batch_sizes)
    profiled = f"profiled: {', '.join(map(str, sizes))}"
    per_replica = f"the global batch {G}" + (f" over {d} replicas" if d > 1 else "")
    dividing = [b for b in sizes if b > 0 and G % (d * b) == 0]
    if not dividing:
        smallest = sizes[0] if sizes else 1
        suggestion = -(-G // (d * smallest)) * d * smallest
        times = f"{d} x " if d > 1 else ""
        return (f"no profiled micro-batch size divides {per_replica} ({profiled}); use a global batch that is a "
                f"multiple of {times}one of them, e.g. {suggestion}, or profile more micro-batch sizes")
    few = [b for b in dividing if G // (d * b) <= MAX_MICRO_BATCHES]
    if not few:
        return (f"{per_replica} makes more than {MAX_MICRO_BATCHES} micro-batches of every profiled size that divides "
                f"it ({profiled}); profile larger micro-batch sizes (up to {G // d // MAX_MICRO_BATCHES} or more), "
                "use more data-parallel replicas (--devices) or a smaller global batch")
    counts = ", ".join(f"{G // (d * b)} of {b}" for b in few)
    return (f"interleaved runs a number of micro-batches that is a multiple of its {p} ranks, and {per_replica} "
            f"makes {counts} ({profiled}); use a global batch that is a multiple of {d * p} x a profiled size, "
            "or another schedule (bfs runs any number)")


def no_layout_message(num_units: int, opts: CostOptions, devices: Optional[int], schedules: Sequence[str]) -> str:
    """Why the request has no layout at all: every p x d = `devices` (or the given p) needs more
    stages than the profile's units, or no d divides the global batch."""
    chunked = [s for s in schedules if schedule_virtual_stages(s) != 1]
    per_rank = f" ({', '.join(chunked)}: several per rank)" if chunked else ""
    if devices is None and (not chunked or opts.pipeline_ranks > num_units):
        # more ranks than units: no schedule, one stage per rank included, has a layout
        return diagnose_stages(opts.pipeline_ranks, num_units)
    if devices is None:
        fewer = " or fewer --virtual-stages" if any(s in MULTI_STAGE_SCHEDULES for s in chunked) else ""
        return (f"{opts.pipeline_ranks} ranks' stages{per_rank} outnumber the profile's {num_units} units; use fewer "
                f"ranks, a schedule with one stage per rank{fewer}, or profile the model with finer partition units")
    replicas = [d for d in range(1, min(devices, opts.global_batch) + 1)
                if devices % d == 0 and opts.global_batch % d == 0]
    return (f"no way to lay out {devices} devices: p pipeline ranks x d replicas = {devices} needs d dividing both "
            f"{devices} and the global batch {opts.global_batch} (d in {replicas}, so p at least "
            f"{devices // max(replicas)}) and the p ranks' stages{per_rank} at most the profile's {num_units} units; "
            f"use another number of devices or global batch, or profile the model with finer partition units")


def infeasible_error(profile: Profile, opts: CostOptions, more: str = "more stages") -> InfeasibleError:
    """The InfeasibleError for (profile, opts), with the memory floor attached when there is one."""
    message = diagnose(profile, opts, more)
    floor = None
    simple = opts.virtual_stages == 1 and opts.device_view is None
    if simple and opts.num_stages <= profile.num_units and candidate_micro_batch_sizes(profile, opts.global_batch, opts):
        found = least_memory_plan(profile, opts)
        floor = found[0].memory_bytes if found is not None else None
    return InfeasibleError(message, min_memory_bytes=floor)
