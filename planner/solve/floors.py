"""Stage floors: the least step of any split that gives stage g the range [a, e), and the split whose
largest floor is least -- the branch and bound's (planner.solve.branch) bound that couples the forms.

Every form k is a constant plus per-stage terms, form_k(split) = c_k + sum_g V_kg(a_g, e_g), and
step(split) >= max_k form_k(split). Fixing stage g = [a, e) alone, the other stages of form k are
at least its best prefix into stages 0..g-1 and its best completion from g+1:

    H_g(a, e) = max_k ( c_k + P_kg(a) + V_kg(a, e) + D_k,g+1(e) ),
    P_k0(0) = 0,  P_k,g+1(e) = min_a P_kg(a) + V_kg(a, e),   D as in branch (the completions)

so step(split) >= H_g(a_g, e_g) for every g, and over the splits of [a, L) into stages g..S-1

    step >= M_g(a) = min_e max( H_g(a, e), M_g+1(e) ),   M_S(L) = -inf

(a min-max partition). The single forms' bound max_k min_split form_k lets each form dodge by
shrinking its own heavy stage; M does not, because every stage must meet its floor at once: the
bottleneck of a 1F1B step (m times one stage's work and messages) is bounded as the closed-form
chain solver bounds it, with every known form's own terms. A range whose floor reaches the target
lies in no faster split and is dropped from the allowed stages, which raises the completions again.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

FORMS_PER_CHUNK = 32  # forms evaluated together (memory: forms x a block's ranges per chunk)
BLOCK_ROWS = 32  # starts per block: a stage's allowed ranges form a band, each block of starts covers its part
BAND_BYTES = 256 << 20  # blocks keep their terms gathered up to this many bytes in all (the rest gather per use)


class OutOfTime(Exception):
    """The deadline passed before the tables were done (what was computed is incomplete: discard it)."""


def check_deadline(deadline: Optional[float]) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise OutOfTime


class Band:
    """Where each stage's allowed ranges lie: per stage, blocks of starts, each a rectangle of
    (a, e) holding the allowed ranges of those starts, with the terms over it (rows[g][term, a, e])."""

    def __init__(self, rows: Sequence[np.ndarray], allowed: Sequence[np.ndarray], budget: int = BAND_BYTES,
                 nonzero: Optional[np.ndarray] = None):
        self.S, self.L = len(allowed), allowed[0].shape[0] - 1
        # the terms some stage's table holds (`nonzero_terms`; the caller's, as the rows never change)
        self.nonzero = nonzero_terms(rows) if nonzero is None else nonzero
        self.blocks: List[List[_Block]] = []
        for g, ok in enumerate(allowed):
            starts = np.flatnonzero(ok.any(axis=1))
            stage = []
            for first in range(int(starts[0]), int(starts[-1]) + 1, BLOCK_ROWS) if starts.size else ():
                a = slice(first, min(int(starts[-1]) + 1, first + BLOCK_ROWS))
                if ok[a].any():
                    stage.append(_Block(rows[g], ok, a))
                    budget -= stage[-1].keep(budget)
            self.blocks.append(stage)


def nonzero_terms(rows: Sequence[np.ndarray]) -> np.ndarray:
    """Per term, whether some stage's table holds it (a term 0 everywhere, as the step where nothing
    is timed or the exchange of one replica, adds nothing to any form: the products skip it)."""
    tables = {id(table): table for table in rows}.values()
    return np.array([any(table[t].any() for table in tables) for t in range(rows[0].shape[0])])


class _Block:
    """The allowed ranges of one stage starting in rows `a`: e in `e`, +inf in `mask` where not allowed."""

    def __init__(self, rows: np.ndarray, allowed: np.ndarray, a: slice):
        ends = np.flatnonzero(allowed[a].any(axis=0))
        self.rows, self.a, self.e = rows, a, slice(int(ends[0]), int(ends[-1]) + 1)
        self.mask = np.where(allowed[self.a, self.e], 0.0, np.inf)
        self.kept = False  # whether the terms it reads stay gathered (`keep`)
        self.terms: Tuple[Tuple[int, ...], np.ndarray] = ((), np.zeros((0, self.mask.size)))

    def keep(self, budget: int) -> int:
        """Keep the terms gathered if every term fits the budget; the bytes taken (at most)."""
        size = self.rows.shape[0] * self.mask.size * 8
        if size > budget:
            return 0
        self.kept = True
        return size

    def values(self, coefficients: np.ndarray, used: Tuple[int, ...]) -> np.ndarray:
        """V_kg(a, e) over the block for a chunk of forms (coefficients[k, term] of the terms `used`),
        +inf where not allowed."""
        if self.terms[0] == used:
            terms = self.terms[1]
        else:
            terms = self.rows[list(used), self.a, self.e].reshape(len(used), -1)
            if self.kept:
                self.terms = (used, terms)
        value = (coefficients @ terms).reshape(len(coefficients), *self.mask.shape)
        value += self.mask
        return value


def _used(coefficients: np.ndarray, band: Band) -> Tuple[int, ...]:
    """The terms that some form counts and some stage's table holds (the products need no others)."""
    return tuple(int(t) for t in np.flatnonzero(coefficients.any(axis=(0, 1)) & band.nonzero))


def form_completions(coefficients: np.ndarray, band: Band, deadline: Optional[float] = None,
                     with_ends: bool = False):
    """D[k, g, a]: form k's least sum over the splits of [a, L) into allowed stages g..S-1 of its
    stage terms (+inf where there is none), every form at once. coefficients[g, k, term]; OutOfTime
    past the deadline. With `with_ends`, also ends[k, g, a]: where stage g ends in that split."""
    S, K, L = band.S, coefficients.shape[1], band.L
    D = np.full((K, S + 1, L + 1), np.inf)
    D[:, S, L] = 0.0
    ends = np.zeros((K, S, L + 1), dtype=int) if with_ends else None
    used = _used(coefficients, band)
    for first in range(0, K, FORMS_PER_CHUNK):
        chunk = slice(first, min(K, first + FORMS_PER_CHUNK))
        for g in range(S - 1, -1, -1):
            check_deadline(deadline)
            for block in band.blocks[g]:
                value = block.values(coefficients[g, chunk][:, used], used)
                value += D[chunk, g + 1, None, block.e]
                if with_ends:
                    best = value.argmin(axis=2)
                    ends[chunk, g, block.a] = best + block.e.start
                    D[chunk, g, block.a] = np.take_along_axis(value, best[..., None], axis=2)[..., 0]
                else:
                    D[chunk, g, block.a] = value.min(axis=2)
    return (D, ends) if with_ends else D


def stage_floors(constant: np.ndarray, coefficients: np.ndarray, band: Band, completion: np.ndarray,
                 deadline: Optional[float] = None) -> List[np.ndarray]:
    """H[g][a, e] (module docstring; +inf where stage g = [a, e) is not allowed or cannot be chained
    from 0 to L, -inf without forms). coefficients[g, k, term], completion[k, g, a]; OutOfTime past
    the deadline."""
    S, K, L = band.S, len(constant), band.L
    floors = []
    for blocks in band.blocks:
        floor = np.full((L + 1, L + 1), np.inf if K else -np.inf)  # no form: no bound
        for block in blocks if K else ():
            floor[block.a, block.e] = -np.inf
        floors.append(floor)
    used = _used(coefficients, band)
    for first in range(0, K, FORMS_PER_CHUNK):
        chunk = slice(first, min(K, first + FORMS_PER_CHUNK))
        prefix = np.full((chunk.stop - chunk.start, L + 1), np.inf)
        prefix[:, 0] = 0.0
        for g in range(S):
            check_deadline(deadline)
            after = np.full_like(prefix, np.inf)
            for block in band.blocks[g]:
                through = block.values(coefficients[g, chunk][:, used], used)
                through += prefix[:, block.a, None]  # P_kg(a) + V_kg(a, e)
                np.minimum(after[:, block.e], through.min(axis=1), out=after[:, block.e])
                through += completion[chunk, g + 1, None, block.e] + constant[chunk, None, None]
                np.maximum(floors[g][block.a, block.e], through.max(axis=0), out=floors[g][block.a, block.e])
            prefix = after
    return floors


def least_largest(floors: Sequence[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """M[g, a] (module docstring) and ends[g, a]: where stage g ends in the split attaining it."""
    S, L = len(floors), floors[0].shape[0] - 1
    M = np.full((S + 1, L + 1), np.inf)
    M[S, L] = -np.inf
    ends = np.zeros((S, L + 1), dtype=int)
    for g in range(S - 1, -1, -1):
        total = np.maximum(floors[g], M[g + 1][None, :])
        ends[g] = total.argmin(axis=1)
        M[g] = total[np.arange(L + 1), ends[g]]
    return M, ends


def split_of(ends: np.ndarray) -> Tuple[int, ...]:
    """The stage ends e_0 .. e_{S-1} = L of the split that `ends` (least_largest's) attains from 0."""
    split, a = [], 0
    for g in range(ends.shape[0]):
        a = int(ends[g, a])
        split.append(a)
    return tuple(split)
