"""`solve`: the best plan by a chosen method — the exact search (integer program over the lists'
paths, proven optimal), its fast heuristic alone ('dp'), the brute-force oracle, or a baseline
other tools use — all judged by planner.cost.model."""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence

from planner.cost.memory import parameter_view_refusal, shard_parameters_refusal
from planner.cost.model import compute_profile, precision_of, rank_caps
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.sizes import format_bytes
from planner.solve.backends import BACKENDS, DEFAULT_BACKEND, choose_backend  # noqa: F401  (re-exported)
from planner.solve.brute import solve_brute
from planner.solve.diagnose import InfeasibleError, infeasible_error, no_layout_message
from planner.solve.search import expand_scenarios, search_scenarios
from planner.solve.solution import OPTIMALITY_GAP, Solution

METHODS = ("ilp", "dp", "brute", "uniform", "params", "block")
# The search's tables hold values for every unit range [a, e): (L + 1)^2 entries, a few float64
# tables alive at once (BENCHMARKS.md, "Profiles of thousands of units")
TABLE_BYTES_PER_RANGE = 80


def available_memory() -> Optional[int]:
    """Bytes this host can still give a process (Linux's MemAvailable); None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_table_room(num_units: int, available: Optional[int] = None) -> None:
    """A one-line ValueError, before any table is built, where the search's tables of every unit
    range would not fit this host's free memory (the run would swap or be killed, silently)."""
    need = TABLE_BYTES_PER_RANGE * (num_units + 1) ** 2
    free = available_memory() if available is None else available
    if free is not None and need > free:
        fits = int((free / TABLE_BYTES_PER_RANGE) ** 0.5) - 1
        raise ValueError(f"the profile has {num_units:,} units: the search's tables of every unit range need about "
                         f"{format_bytes(need)}, and this host has {format_bytes(free)} free; solve where more "
                         f"memory is free, or profile the model as at most {fits:,} units (larger units: "
                         "docs/profile.md, \"How many units\")")


def solve_ilp(profile: Profile, opts: CostOptions, time_limit: Optional[float] = None,
              backend: Optional[str] = None, warm_start: bool = True) -> Solution:
    """The ILP on exactly these options (one schedule, p, d): optimal plan with a proven bound.

    warm_start=False solves every micro-batch size's program alone, without the DP incumbent, its
    variable fixing or pruning (tests use this to check the integer program by itself).
    """
    return solve(profile, opts, method="ilp", time_limit=time_limit, backend=backend, warm_start=warm_start)


def solve(profile: Profile, opts: CostOptions, method: str = "ilp", time_limit: Optional[float] = None,
          backend: Optional[str] = None, devices: Optional[int] = None,
          schedules: Optional[Sequence[str]] = None, warm_start: bool = True,
          virtual_stages: Optional[int] = None, gap: float = OPTIMALITY_GAP,
          progress: Optional[Callable[[str], None]] = None) -> Solution:
    """The best plan for (profile, opts) by `method`; raises InfeasibleError when none exists.

    devices: choose p x d = devices (opts.pipeline_ranks is then ignored); schedules: candidate
    schedules to choose from (default: opts.schedule alone); virtual_stages: v for interleaved/bfs;
    backend: the ILP's MIP solver, 'highs' or 'cbc' (default: highs, cbc where highspy cannot be
    imported; planner.solve.backends.choose_backend); gap: the exact search stops once no plan can
    be faster than its plan by more than this share (default: proven optimal); progress: told the best
    plan and the bound in one line each time a scenario's search moves them (planner.solve.search).
    """
    opts.validate()
    if devices is not None and devices < 1:
        raise ValueError(f"--devices must be at least 1 (got {devices})")
    scenarios = expand_scenarios(opts, profile.num_units, devices, schedules, virtual_stages)
    scenarios = runnable_shardings(profile, opts, scenarios)
    if not scenarios:
        raise InfeasibleError(no_layout_message(profile.num_units, opts, devices, list(schedules or [opts.schedule])))
    return solve_scenarios(profile, opts, scenarios, method=method, time_limit=time_limit, backend=backend,
                           warm_start=warm_start, gap=gap, progress=progress)


def runnable_shardings(profile: Profile, opts: CostOptions, scenarios: Sequence[CostOptions],
                       replicated: bool = False) -> List[CostOptions]:
    """Under `--shard auto`, the scenarios whose sharding `runtime execute` runs: no parameters (ZeRO-3)
    where the schedule, precision or replicated stages refuse it, or the model passes on a view of a
    parameter (planner.cost.memory); a shard the user named is planned as asked (with a note)."""
    if opts.shard != "auto":
        return list(scenarios)
    views = parameter_view_refusal(profile.units)
    return [s for s in scenarios if s.shard != "parameters" or views is None and shard_parameters_refusal(
        precision_of(s, profile.dtype, profile.precision), s.schedule, replicated or s.replicated) is None]


def _without_needless_recompute(profile: Profile, opts: CostOptions) -> CostOptions:
    """`--recompute auto` where no device has a memory cap is `none`: recomputing only adds work to
    a step whose memory nothing bounds. Said so, the search takes the branch and bound over splits
    (planner.solve.branch), which does not take per-unit choices, instead of the integer program
    (BENCHMARKS.md, "The command's default on the PipeDream profiles")."""
    if opts.recompute == "auto" and all(cap is None for cap in rank_caps(opts, profile)):
        return dataclasses.replace(opts, recompute="none")
    return opts


def solve_scenarios(profile: Profile, opts: CostOptions, scenarios: Sequence[CostOptions], method: str = "ilp",
                    time_limit: Optional[float] = None, backend: Optional[str] = None,
                    warm_start: bool = True, gap: float = OPTIMALITY_GAP,
                    progress: Optional[Callable[[str], None]] = None) -> Solution:
    """The best plan over these concrete scenarios of `opts` by `method` (solve's rules), as ONE
    search: time_limit bounds the whole search and the certificate (bound, gap, status) holds over
    every scenario; raises InfeasibleError when none has a plan."""
    profile = compute_profile(profile, opts)  # activations and messages in the precision's compute dtype
    if method not in METHODS:
        raise ValueError(f"unknown solve method {method!r}; use one of {', '.join(METHODS)}")
    if not 0 <= gap < 1:
        raise ValueError(f"the optimality gap must be at least 0 and below 1, e.g. --gap 0.01 (got {gap})")
    if gap > OPTIMALITY_GAP and method != "ilp":
        raise ValueError(f"a gap stops the exact search (method ilp); method {method} does not search")
    backend, _ = choose_backend(backend)
    scenarios = [_without_needless_recompute(profile, scenario) for scenario in scenarios]
    for scenario in scenarios:
        scenario.validate()
    found: Optional[Solution] = None
    if method in ("ilp", "dp"):
        check_table_room(profile.num_units)
        found = search_scenarios(profile, scenarios, method, time_limit=time_limit, backend=backend,
                                 warm_start=warm_start, gap=gap, progress=progress)
    elif method == "brute":
        best = None
        for scenario in scenarios:
            candidate = solve_brute(profile, scenario)
            if candidate is not None and (best is None or candidate.objective < best.objective):
                best = candidate
        found = best
    else:
        from planner.solve.baselines import solve_baseline
        found = solve_baseline(profile, scenarios, method)
        if found is not None and not found.cost.feasible:
            found = None
    if found is None:
        raise _no_plan(profile, opts, scenarios, method)
    return found


def _no_plan(profile: Profile, opts: CostOptions, scenarios: Sequence[CostOptions], method: str) -> InfeasibleError:
    """Why none of the scenarios has a plan by `method`: the first one's diagnosis, said of all of
    them where several layouts were tried, or of the baseline's own split where another fits."""
    first = scenarios[0] if scenarios else opts
    layouts = sorted({(s.pipeline_ranks, s.data_parallel, s.schedule, s.virtual_stages) for s in scenarios})
    several_p = len({p for p, _, _, _ in layouts}) > 1
    error = infeasible_error(profile, first, "more devices" if several_p else "more stages")
    message, floor = str(error), error.min_memory_bytes
    if method in ("uniform", "params", "block") and floor is not None and (first.memory_cap is None or
                                                                         floor <= first.memory_cap):
        return InfeasibleError(f"the {method} baseline's split does not fit the memory per device, but another split "
                               f"does (the smallest memory per device for {first.pipeline_ranks} stages is "
                               f"{format_bytes(floor)}); --method ilp finds the best one", min_memory_bytes=floor)
    if len(layouts) > 1:
        tried = ", ".join(f"{p} x {d} {schedule}" + (f" v={v}" if v > 1 else "") for p, d, schedule, v in layouts[:6])
        more = f" and {len(layouts) - 6} more" if len(layouts) > 6 else ""
        return InfeasibleError(f"none of the {len(layouts)} layouts tried (pipeline ranks x replicas: {tried}{more}) "
                               f"has a plan; e.g. {message}", min_memory_bytes=error.min_memory_bytes)
    return error

