"""Moves of a split's boundaries that lower its simulated step: the local search that polishes an
incumbent (every boundary moved by one unit, round after round; with several stages per device, runs
of consecutive boundaries moved together) and the perturbations whose longest paths seed the exact
search's forms (planner.solve.exact). Each split is simulated with its recomputation re-chosen under
--recompute auto; its longest path joins the caller's forms.
"""
from __future__ import annotations

import random
import time
from typing import Iterable, List, Optional, Set

from planner.cost.model import evaluate, simulate_splits
from planner.cost.options import CostOptions
from planner.cost.result import PathForm
from planner.profile.profile import Profile
from planner.solve.recompute import recompute_for
from planner.solve.solution import Candidate

LOCAL_SEARCH_ROUNDS = 50


def neighbours(boundaries: List[int], num_units: int) -> Iterable[List[int]]:
    """Every split with one boundary moved by one unit (each stage keeping a unit at least)."""
    return _runs_moved(boundaries, num_units, range(1, 2))


def _runs_moved(boundaries: List[int], num_units: int, lengths: Iterable[int]) -> Iterable[List[int]]:
    """Every run of consecutive boundaries of each of `lengths` moved one unit together, in that order, where
    each stage keeps a unit at least."""
    n = len(boundaries)
    for length in lengths:
        for j in range(n - length + 1):
            for step in (-1, 1):
                moved = list(boundaries)
                for k in range(j, j + length):
                    moved[k] += step
                low = moved[j - 1] if j > 0 else 0
                high = moved[j + length] if j + length < n else num_units
                if low < moved[j] and moved[j + length - 1] < high:
                    yield moved


def _redo(profile: Profile, boundaries: List[int], b: int, opts: CostOptions,
          recompute: Optional[List[int]]) -> List[int]:
    """The units a split recomputes: `recompute`, else the least its memory needs (all when nothing fits)."""
    redo = recompute if recompute is not None else recompute_for(profile, boundaries, b, opts, exact=False)
    if redo is None:
        redo = list(range(profile.num_units)) if opts.recompute != "none" else []
    return redo


def candidate_of(profile: Profile, boundaries: List[int], b: int, opts: CostOptions, recompute: List[int],
                 forms: Set[PathForm]) -> Optional[Candidate]:
    """The candidate if the split is feasible (recording its longest path either way). A ValueError
    from `evaluate` (a scenario it refuses whatever the split) propagates: taken for an unfitting
    split, it would have the program cut off every split in turn."""
    redo = _redo(profile, boundaries, b, opts, recompute)
    cost = evaluate(profile, boundaries, b, opts, redo)
    forms.add(cost.critical_path)
    return Candidate(cost.iteration_s, list(boundaries), list(redo)) if cost.feasible else None


def _best_of(profile: Profile, b: int, opts: CostOptions, moves: List[List[int]], recompute: Optional[List[int]],
             forms: Set[PathForm], below: float, deadline: Optional[float] = None,
             screened_forms: Optional[Set[PathForm]] = None) -> Optional[Candidate]:
    """The fastest feasible split of `moves` (the first of equals) if it is faster than `below`: all
    simulated at once (their longest paths join `screened_forms`, by default `forms`), then evaluated
    fastest first until one fits its memory (the longest paths of those join `forms`). Past `deadline`
    (time.perf_counter()) the moves not yet given their recomputation are left out (choosing it is the
    slow part under --recompute auto)."""
    redos = []
    for moved in moves:
        if redos and deadline is not None and time.perf_counter() > deadline:
            moves = moves[:len(redos)]
            break
        redos.append(_redo(profile, moved, b, opts, recompute))
    screened = simulate_splits(profile, list(zip(moves, redos)), b, opts)
    (forms if screened_forms is None else screened_forms).update(found[1] for found in screened if found is not None)
    order = sorted((found[0], k) for k, found in enumerate(screened) if found is not None)
    for step, k in order:
        if not step < below:
            return None
        kept = candidate_of(profile, moves[k], b, opts, redos[k], forms)
        if kept is not None:
            return kept
    return None


def local_search(profile: Profile, b: int, opts: CostOptions, start: Candidate, forms: Set[PathForm],
                 deadline: Optional[float] = None) -> Candidate:
    """Move one boundary by one unit while that lowers the simulated step (recomputation re-chosen),
    round after round until none does or the deadline (time.perf_counter()) passed. With several stages
    per device (v > 1), where no such move helps, a run of consecutive boundaries moved together
    (`_shifted`) is tried before it stops."""
    best = start
    for _ in range(LOCAL_SEARCH_ROUNDS):
        if deadline is not None and time.perf_counter() > deadline:
            break
        moves = list(neighbours(best.boundaries, profile.num_units))
        found = _best_of(profile, b, opts, moves, None if opts.recompute == "auto" else best.recompute, forms,
                         best.iteration_s * (1 - 1e-12), deadline)
        if found is None and opts.virtual_stages > 1:
            found = _shifted(profile, b, opts, best, forms, deadline)
        if found is None:
            break
        best = found
    return best


SHIFT_BATCH = 64  # chain shifts simulated at once; the first batch with a faster split ends the round


def _shifts(boundaries: List[int], num_units: int) -> Iterable[List[int]]:
    """Every run of 2 or more consecutive boundaries moved one unit together, shortest runs first: a unit
    handed along the stages between them (one stage's range shifted whole). With several stages per
    device the best splits differ from their neighbours in such runs (a device's two stages lie far
    apart, and what one gives up another far away must take)."""
    return _runs_moved(boundaries, num_units, range(2, len(boundaries) + 1))


def _shifted(profile: Profile, b: int, opts: CostOptions, start: Candidate, forms: Set[PathForm],
             deadline: Optional[float] = None) -> Optional[Candidate]:
    """A split faster than `start` among its chain shifts (`_shifts`), simulated SHIFT_BATCH at a time (the
    fastest of the first batch holding a faster one that fits), or None; only the longest paths of the splits
    evaluated in full (it, and any faster that did not fit) join `forms` (the S^2 screened paths would slow
    every node of a later search). None past `deadline`."""
    moves = list(_shifts(start.boundaries, profile.num_units))
    recompute = None if opts.recompute == "auto" else start.recompute
    for first in range(0, len(moves), SHIFT_BATCH):
        if deadline is not None and time.perf_counter() > deadline:
            return None
        found = _best_of(profile, b, opts, moves[first:first + SHIFT_BATCH], recompute, forms,
                         start.iteration_s * (1 - 1e-12), deadline, screened_forms=set())
        if found is not None:
            return found
    return None


PERTURBATIONS = 200


def perturbations(profile: Profile, b: int, opts: CostOptions, start: Candidate, forms: Set[PathForm],
                  deadline: Optional[float] = None) -> Candidate:
    """Simulate splits near `start` (a few boundaries moved by one or two units): their longest paths
    are the forms the program needs near the optimum; a better split found on the way is kept (as
    many as `deadline`, time.perf_counter(), leaves time for)."""
    rng = random.Random(len(start.boundaries) * 7919 + b)
    L, moves = profile.num_units, []
    for _ in range(PERTURBATIONS):
        moved = list(start.boundaries)
        for j in rng.sample(range(len(moved)), k=min(len(moved), rng.randint(1, 3))):
            moved[j] += rng.choice((-2, -1, 1, 2))
        if all(0 < x < L for x in moved) and all(x < y for x, y in zip(moved, moved[1:])):
            moves.append(moved)
    found = _best_of(profile, b, opts, moves, None if opts.recompute == "auto" else start.recompute, forms,
                     start.iteration_s, deadline)
    return found if found is not None else start
