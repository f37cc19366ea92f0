"""The best plan on a leveled topology (`planner solve --topology`, issue 22): the pipeline depth p
and data-parallel degree d with p d = N devices, the placement of every (replica, pipeline rank) on
the devices, and the split, by the chosen method per placement.

Every placement is enumerated, one per cost signature (planner.cost.placement.placements: replicas
are interchangeable, and placements the cost model cannot tell apart are solved once), and each is
solved exactly like a cluster (planner.solve.api.solve): its pipeline messages priced at the link
each boundary crosses, its exchange hierarchical. The best over placements is kept; its bound is
the smallest bound over the placements solved (a placement without a feasible plan bounds
nothing), so the reported gap stays a true gap. Limits: N <= MAX_SEARCHED_DEVICES (N! / d!
orders are enumerated) and one solve per distinct placement (for 2 sites x 2 devices: 9 over
p = 4, 2 and 1).
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

from planner.cost.options import CostOptions
from planner.cost.placement import Placement, placements
from planner.cost.topology_file import DeviceTopology
from planner.profile.profile import Profile
from planner.solve.diagnose import InfeasibleError
from planner.solve.search import device_splits
from planner.solve.solution import OPTIMALITY_GAP, Solution


def shapes(topology: DeviceTopology, opts: CostOptions, num_units: int,
           pipeline_ranks: Optional[int] = None) -> List[Tuple[int, int]]:
    """(p, d) with p d = N, d dividing the global batch, p at most the units (and = pipeline_ranks if given)."""
    return [(p, d) for p, d in device_splits(topology.num_devices, opts.global_batch)
            if p <= num_units and (pipeline_ranks is None or p == pipeline_ranks)]


def candidates(topology: DeviceTopology, opts: CostOptions, num_units: int,
               pipeline_ranks: Optional[int] = None) -> List[Placement]:
    """Every distinct placement over every shape."""
    return [placement for p, d in shapes(topology, opts, num_units, pipeline_ranks)
            for placement in placements(topology, p, d)]


def scenario_of(opts: CostOptions, placement: Placement) -> CostOptions:
    """The scenario of one placement: its p and d, and the placement itself."""
    return opts.with_(pipeline_ranks=placement.pipeline_ranks, data_parallel=placement.data_parallel,
                      placement=placement)


def solve_on_topology(profile: Profile, opts: CostOptions, topology: DeviceTopology, method: str = "ilp",
                      pipeline_ranks: Optional[int] = None, time_limit: Optional[float] = None,
                      backend: Optional[str] = None, schedules: Optional[Sequence[str]] = None,
                      virtual_stages: Optional[int] = None) -> Solution:
    """The best plan over every placement (module docstring); InfeasibleError if none fits.
    pipeline_ranks: only placements of that depth; time_limit: for each placement's solve."""
    from planner.solve.api import solve

    options = candidates(topology, opts, profile.num_units, pipeline_ranks)
    if not options:
        raise ValueError(f"no pipeline depth p with p x d = the topology's {topology.num_devices} devices fits "
                         f"(d must divide the global batch {opts.global_batch}, p at most the {profile.num_units} "
                         "units" + (f", p = --stages {pipeline_ranks}" if pipeline_ranks else "") + ")")
    best: Optional[Solution] = None
    bounds: List[float] = []
    last_error: Optional[InfeasibleError] = None
    started = time.perf_counter()
    for placement in options:
        try:
            found = solve(profile, scenario_of(opts, placement), method=method, time_limit=time_limit,
                          backend=backend, schedules=schedules, virtual_stages=virtual_stages)
        except InfeasibleError as e:
            last_error = e
            if time_limit is not None:  # maybe only out of time before a plan: no bound is proven there
                bounds.append(0.0)
            continue
        bounds.append(found.bound)
        if best is None or found.objective < best.objective:
            best = found
    if best is None:
        assert last_error is not None
        raise last_error
    best.bound = min(bounds)  # every placement's: the status says what holds over all of them
    best.gap = (best.objective - best.bound) / best.objective if best.objective > 0 else 0.0
    best.status = "optimal" if best.gap <= OPTIMALITY_GAP else "feasible"
    best.seconds = time.perf_counter() - started
    return best
