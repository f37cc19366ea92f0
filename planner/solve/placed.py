"""The best plan on a leveled topology (`planner solve --topology`, issue 22): the pipeline depth p
and data-parallel degree d with p d = N devices, the placement of every (replica, pipeline rank) on
the devices, and the split, by the chosen method.

Every placement is enumerated, one per cost signature (planner.cost.placement.placements: replicas
are interchangeable, and placements the cost model cannot tell apart are solved once), and every
placement's scenarios are solved in ONE search (planner.solve.api.solve_scenarios), each like a
cluster's: its pipeline messages priced at the link each boundary crosses, its exchange
hierarchical. The time limit is the whole search's, and its certificate (bound, gap, status) holds
over every placement. Limits: N <= MAX_SEARCHED_DEVICES (N! / d! orders are enumerated); for
2 sites x 2 devices 3 + 3 + 1 placements over p = 4, 2 and 1.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from planner.cost.options import CostOptions
from planner.cost.placement import Placement, placements
from planner.cost.topology_file import DeviceTopology
from planner.profile.profile import Profile
from planner.solve.search import device_splits, expand_scenarios
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


def topology_scenarios(opts: CostOptions, topology: DeviceTopology, num_units: int,
                       pipeline_ranks: Optional[int] = None, schedules: Optional[Sequence[str]] = None,
                       virtual_stages: Optional[int] = None) -> List[CostOptions]:
    """Every placement's scenarios (planner.solve.search.expand_scenarios of each scenario_of)."""
    return [scenario for placement in candidates(topology, opts, num_units, pipeline_ranks)
            for scenario in expand_scenarios(scenario_of(opts, placement), num_units, None, schedules,
                                             virtual_stages)]


def solve_on_topology(profile: Profile, opts: CostOptions, topology: DeviceTopology, method: str = "ilp",
                      pipeline_ranks: Optional[int] = None, time_limit: Optional[float] = None,
                      backend: Optional[str] = None, schedules: Optional[Sequence[str]] = None,
                      virtual_stages: Optional[int] = None, gap: float = OPTIMALITY_GAP) -> Solution:
    """The best plan over every placement (module docstring); InfeasibleError if none fits.
    pipeline_ranks: only placements of that depth; time_limit and gap: for the whole search."""
    from planner.solve.api import runnable_shardings, solve_scenarios
    from planner.solve.diagnose import InfeasibleError, no_layout_message

    opts.validate()
    if not candidates(topology, opts, profile.num_units, pipeline_ranks):
        raise ValueError(f"no pipeline depth p with p x d = the topology's {topology.num_devices} devices fits "
                         f"(d must divide the global batch {opts.global_batch}, p at most the {profile.num_units} "
                         "units" + (f", p = --stages {pipeline_ranks}" if pipeline_ranks else "") + ")")
    scenarios = runnable_shardings(profile, opts, topology_scenarios(opts, topology, profile.num_units, pipeline_ranks,
                                                                     schedules, virtual_stages))
    if not scenarios:  # every shape's ranks hold more stages than the units (zb-v, interleaved, bfs): say so, as
        # planner.solve.api.solve does, rather than diagnose options no scenario has (shard 'auto', p = N)
        raise InfeasibleError(no_layout_message(profile.num_units, opts, topology.num_devices,
                                                list(schedules or [opts.schedule])))
    return solve_scenarios(profile, opts, scenarios, method=method, time_limit=time_limit, backend=backend, gap=gap)
