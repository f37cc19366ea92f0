"""What `planner solve --replicate` says when it returns no plan (planner.solve.replicas): that none fits
(InfeasibleError, with the least memory one needs), or that none was found and none proven impossible
(NoPlanInTime: the time limit ran out, or the replica tuples were too many to search one by one), each in
one line that says what to do.
"""
from __future__ import annotations

import math
from typing import List, Optional

from planner.cost.model import fixed_bytes
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.sizes import format_bytes
from planner.solve.diagnose import InfeasibleError, NoPlanInTime
from planner.solve.floors import OutOfTime
from planner.solve.replica_tables import ReplicaTables


def infeasible(profile: Profile, opts: CostOptions, devices: int, sizes: List[int],
                deadline: Optional[float] = None) -> InfeasibleError:
    """Why no replicated plan fits, with the least memory one needs (its tables: past `deadline`, said
    without it)."""
    if not sizes:
        return InfeasibleError(f"no profiled micro-batch size ({', '.join(map(str, profile.micro_batch_sizes))}) "
                               f"divides the global batch {opts.global_batch} over {opts.data_parallel} "
                               "data-parallel replicas; change --global-batch")
    least = None  # (memory, b)
    try:
        for b in sizes:
            value, plan = ReplicaTables(profile, b, opts, devices, deadline=deadline).min_memory()
            if plan is not None and (least is None or value < least[0]):
                least = (value + fixed_bytes(profile, opts), b)
    except OutOfTime:
        cap = format_bytes(opts.memory_cap) if opts.memory_cap is not None else "unlimited memory"
        return InfeasibleError(f"the replicated search found no plan on {devices} devices within {cap} per device "
                               "(the least memory one needs was not computed within the time limit); allow more "
                               "memory or use more --stages")
    if least is None:
        return InfeasibleError(f"no replicated plan fills {devices} devices: at most {profile.num_units} stages "
                               "with no more replicas than micro-batches each; use fewer --stages or a larger "
                               "--global-batch")
    cap = format_bytes(opts.memory_cap) if opts.memory_cap is not None else "unlimited memory"
    return InfeasibleError(f"the replicated search found no plan on {devices} devices within {cap} per device; "
                           f"one fits in {format_bytes(least[0])} (micro-batch size {least[1]}): allow at least "
                           f"{format_bytes(least[0])} ({math.ceil(least[0])} bytes) or use more --stages",
                           min_memory_bytes=least[0])


def too_many_tuples(tuples: int, limit: int, devices: int) -> NoPlanInTime:
    """Neither a plan nor a proof that none fits, because the replica tuples were too many to search one by one."""
    return NoPlanInTime(f"no replicated plan found on {devices} devices, and none proven impossible either: the "
                        f"bounded tables found none under the cap, and the {tuples} replica tuples left are too many "
                        f"to search exhaustively (at most {limit}); allow more memory per device, use fewer "
                        "--stages (fewer tuples), or solve without --replicate")


def no_plan_in_time(time_limit: Optional[float]) -> NoPlanInTime:
    """Neither a plan nor a proof that none fits, because a search stopped at the time limit."""
    return NoPlanInTime(f"no replicated plan found within the time limit of {time_limit:g} s, and none proven "
                        "impossible either; allow more time (--time-limit)")


__all__ = ["infeasible", "no_plan_in_time", "too_many_tuples"]
