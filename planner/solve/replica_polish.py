"""A replicated plan improved by the exact model one move at a time (a boundary by one unit, or one
device from a stage to another): planner.solve.replicas searches the fill-drain form, which the
simulation of the lists does not always agree with."""
from __future__ import annotations

import itertools
import time
from typing import List, Optional

from planner.cost.model import evaluate, num_micro_batches
from planner.cost.options import CostOptions
from planner.profile.profile import Profile
from planner.solve.chain import TOL
from planner.solve.replica_tables import replicates_running_stats


POLISH_ROUNDS = 50  # moves kept at most, each the first improving one found


def polished(profile: Profile, chosen: CostOptions, b: int, redo: List[int], boundaries: List[int],
             deadline: Optional[float] = None):
    """The plan improved by the exact model, one move at a time (a boundary by one unit, or one device
    from a stage to another), while a move makes it faster and still fit: the search optimised the
    fill-drain form, which the simulation of the lists does not always agree with. Past `deadline`
    (time.perf_counter(); each move is a simulation) the best so far. (options, boundaries, cost) of
    the plan kept."""
    L, m = profile.num_units, num_micro_batches(chosen, b)
    reps = list(chosen.replicas or [1] * (len(boundaries) + 1))
    best = evaluate(profile, boundaries, b, chosen, redo)
    for _ in range(POLISH_ROUNDS):
        for moved, spread in replica_moves(boundaries, reps, L, m):
            options = chosen.with_(replicas=tuple(spread) if max(spread) > 1 else ())
            if replicates_running_stats(profile, moved, tuple(spread)):
                continue
            if deadline is not None and time.perf_counter() > deadline:
                return chosen, boundaries, best
            cost = evaluate(profile, moved, b, options, redo)
            if cost.feasible and cost.iteration_s < best.iteration_s * (1 - TOL):
                chosen, boundaries, reps, best = options, moved, spread, cost
                break
        else:
            break
    return chosen, boundaries, best


def replica_moves(boundaries: List[int], reps: List[int], L: int, m: int):
    """The plans one move away: a boundary by one unit; one device from a replicated stage to another."""
    for j in range(len(boundaries)):
        for step in (-1, 1):
            moved = boundaries[:j] + [boundaries[j] + step] + boundaries[j + 1:]
            if all(a < e for a, e in zip([0] + moved, moved + [L])):
                yield moved, reps
    for g, h in itertools.permutations(range(len(reps)), 2):
        if reps[g] > 1 and reps[h] < m:
            spread = list(reps)
            spread[g], spread[h] = spread[g] - 1, spread[h] + 1
            yield boundaries, spread
