"""The search's tables: each stage's duration terms over every range (`StageTerms`) and the path
forms as arrays with their completions and stage floors (`Forms`); planner.solve.branch states
the bound they make and searches with them.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from planner.cost.model import (boundary_links, collective_latency, exchange_latency, num_micro_batches,
                                rank_speeds, sync_time)
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs, range_matrix
from planner.cost.result import PathForm
from planner.profile.profile import Profile
from planner.solve.floors import (Band, OutOfTime, check_deadline, form_completions, least_largest, nonzero_terms,
                                  split_of, stage_floors)
from planner.solve.reach import stage_conditions
from planner.solve.recompute_bound import bounded, least_recompute

FLOOR_ROUNDS = 2  # floors, then completions over the ranges left: at most this many rounds per refresh
PROBE_ROUNDS = 8  # the same in a probe below the target (`Forms.probe`): the ranges dropped there raise M most
STAGE_TERMS = ("forward", "backward", "backward_input", "backward_weight", "act", "grad", "reduce", "step")
TABLE_BYTES = 2 << 30  # beyond, the integer program (BENCHMARKS.md: 0.74 GB at 1,251 units and 16 like stages)


def table_bytes(num_units: int, opts: CostOptions) -> int:
    """What the search's tables over every range take: the stage terms (one table per kind of
    device, at most one per stage where devices differ), the floors and the allowed ranges per stage
    (the band's gathered terms, at most floors.BAND_BYTES, come on top)."""
    S, cells = opts.num_stages, (num_units + 1) ** 2
    # like devices: inner stages and the last one; a stage apiece where devices differ or each adds its
    # own least recomputation (planner.solve.recompute_bound)
    tables = S if opts.device_view is not None or bounded(opts) else 2
    return (tables * len(STAGE_TERMS) * 8 + S * (8 + 3)) * cells


def stages_on_ranks(ranks: Sequence[int]) -> Dict[int, List[int]]:
    """rank -> the stages it runs, from each stage's rank."""
    on_rank: Dict[int, List[int]] = {}
    for g, rank in enumerate(ranks):
        on_rank.setdefault(rank, []).append(g)
    return on_rank


def term_parts(term: Tuple, num_stages: int, on_rank: Dict[int, List[int]]) -> Optional[List[Tuple[int, int]]]:
    """The (stage, STAGE_TERMS index) pairs whose sum is a duration term of the step graph: a stage's
    own, or a device's gradient exchange and optimizer step as the sum over its stages; None for a
    term no stage owns (the per-message cost, a collective's)."""
    if term[0] in ("reduce", "step") and term[1] in on_rank:
        return [(g, STAGE_TERMS.index(term[0])) for g in on_rank[term[1]]]
    if term[0] in STAGE_TERMS and isinstance(term[1], int) and 0 <= term[1] < num_stages:
        return [(term[1], STAGE_TERMS.index(term[0]))]
    return None


class StageTerms:
    """Each stage's duration terms over every range [a, e) (seconds; +inf where e <= a), and where
    each stage fits its device's memory. OutOfTime past `deadline` (time.perf_counter()): at 2,000
    units they take seconds to build, which a search's time limit may not have. Under `--recompute
    auto` (one stage per device, planner.solve.recompute_bound) each stage's backward carries the least
    recomputation its range needs to fit, and a range fits where some recomputation makes it: the
    terms then bound a split's step from below, which its own recomputation may exceed (`redo_bound`)."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, deadline: Optional[float] = None):
        costs = range_costs(profile, b, opts.optimizer)
        L, S = profile.num_units, opts.num_stages
        self.L, self.S = L, S
        redo_all = opts.recompute == "all"
        again = costs.AGAIN if redo_all else 0.0
        ranks = [opts.rank_of_stage(g) for g in range(S)]
        device_speeds, links = rank_speeds(opts), boundary_links(opts)
        speeds = [device_speeds[ranks[g]] for g in range(S)]
        m = num_micro_batches(opts, b)
        forward = range_matrix(costs.F) + costs.call_forward
        backward = range_matrix(costs.G + again) + costs.call_backward
        check_deadline(deadline)
        backward_input, backward_weight = costs.split_matrices(again)
        check_deadline(deadline)
        params, trainable, regathered = range_matrix(costs.P), range_matrix(costs.T), range_matrix(costs.FB)
        check_deadline(deadline)
        finite = np.isfinite(params)
        params, trainable = np.where(finite, params, 0.0), np.where(finite, trainable, 0.0)
        regathered = np.where(finite, regathered, 0.0)
        collectives = np.where(finite, range_matrix(costs.COLL), 0.0)
        buffers = np.where(finite, range_matrix(costs.BUF), 0.0)  # averaged under local SGD
        step = range_matrix(costs.O)
        ends = np.arange(L + 1)
        from planner.cost.stage_memory import StageMemory

        memory = StageMemory(profile, b, opts, redo_all)
        # R_g[a, e]: the least recomputation stage g = [a, e) needs to fit (None: recomputation is fixed)
        self.redo_bound = bounded(opts) and any(memory.cap(g) is not None for g in range(S))
        least = least_recompute(memory, costs, opts, b) if self.redo_bound else None
        check_deadline(deadline)
        # rows[g][t, a, e] = term t of stage g = [a, e), 0 where not a range; stages whose terms are alike
        # (speed, messages, exchange) share one table: at 1,000 units each is 8 (L + 1)^2 floats
        self.rows: List[np.ndarray] = []
        tables: Dict[tuple, np.ndarray] = {}
        for g in range(S):
            check_deadline(deadline)
            # sync_time is linear in the bytes: its value per trainable, frozen and buffer byte says it all
            exchange_per_byte = tuple(sync_time(*probe, opts, profile.dtype, m, rank=ranks[g], buffer_bytes=buffer)
                                      for *probe, buffer in ((1.0, 1.0, 0.0, 0.0), (1.0, 0.0, 0.0, 0.0),
                                                             (0.0, 0.0, 0.0, 1.0)))
            # ZeRO-3 under a placement: one ring's latency per gather and reduce-scatter (planner.cost.model)
            per_collective = m * collective_latency(opts, ranks[g])
            # the stage's share of its device's exchange over the replicas (hierarchical under a placement:
            # per rank); the device's rings' latency is paid when any of its v stages exchanges bytes: each
            # such stage carries 1/v of it (exact for v = 1; at most the latency, so a bound, for v > 1)
            latency = exchange_latency(opts, ranks[g]) / len(opts.stages_on(ranks[g]))
            act = np.array([costs.message_s(e, links[g]) if 0 < e < L and g < S - 1 else 0.0 for e in ends])
            grad = np.array([costs.message_s(e, links[g], gradient=True) if 0 < e < L and g < S - 1 else 0.0
                             for e in ends])  # the messages across boundary g, by where stage g ends
            key = (speeds[g], exchange_per_byte, per_collective, latency, act.tobytes(), grad.tobytes())
            if key not in tables:
                exchange = sync_time(params, trainable, regathered, opts, profile.dtype, m, rank=ranks[g],
                                     buffer_bytes=buffers)
                exchange = exchange + per_collective * collectives
                reduce = exchange + np.where(exchange > 0, latency, 0.0)
                terms = {"forward": forward, "backward": backward, "backward_input": backward_input,
                         "backward_weight": backward_weight, "step": step}
                table = np.zeros((len(STAGE_TERMS), L + 1, L + 1))
                for t, name in enumerate(STAGE_TERMS):  # in place: no (terms, L + 1, L + 1) temporaries
                    if name in terms:
                        np.divide(terms[name], speeds[g], out=table[t], where=finite)
                    else:  # act and grad by the stage's end: the same on every row
                        np.copyto(table[t], {"reduce": reduce, "act": act, "grad": grad}[name], where=finite)
                table[~np.isfinite(table)] = 0.0  # in place (nan_to_num takes three passes and copies)
                tables[key] = table
            self.rows.append(tables[key])
        self.nonzero = nonzero_terms(self.rows)
        # R_g joins a stage's backward once a range allowed for it needs recomputation (`restrict`): a
        # table apiece costs 8 (L + 1)^2 floats, and the like stages' table alone is a (weaker) bound
        self.least, self.own = least, [False] * S
        self.fits = self._memory(memory, costs, least, deadline)
        check_deadline(deadline)
        self.allowed: List[np.ndarray] = []  # fits, and may lie in a split faster than the target (restrict)
        self.band: Optional[Band] = None  # where the allowed ranges lie (planner.solve.floors)
        self.allow(list(self.fits))
        self.costs, self.speeds, self.redo_all, self.ranks = costs, speeds, redo_all, ranks
        self.zero_bubble = opts.schedule == "zb-h1"

    def restrict(self, forms: Sequence[PathForm], target: float, deadline: Optional[float] = None) -> None:
        """allowed[g][a, e]: stage g = [a, e) fits and meets every form's per-stage condition for a
        step below `target` (planner.solve.reach: a stage too heavy for any split to beat it). Only the
        ranges allowed now are tested: the target only falls and the forms only grow, so no other range
        can come back (and one the floors dropped stays dropped: they only rise)."""
        ok = stage_conditions(self.costs, self.S, self.speeds, [f.count() for f in forms if not f.crossings],
                              target, recompute_all=self.redo_all, within=self.allowed, deadline=deadline)
        allowed = [fits & good for fits, good in zip(self.fits, ok)]
        if self.least is not None:
            self._own_backward(allowed)
        self.allow(allowed)

    def _own_backward(self, allowed: List[np.ndarray]) -> None:
        """Each stage with an allowed range that needs recomputation to fit gets its own table: its like
        stages' terms, its backward with R_g added (once: the allowed ranges only shrink)."""
        backward = STAGE_TERMS.index("backward")
        # zero bubble: a recomputed forward runs in both parts, the input part's only where the stage's
        # input carries a gradient (planner.cost.ranges' `whole`: the first stage's input part runs nothing)
        parts = [] if not self.zero_bubble else \
            [(STAGE_TERMS.index("backward_input"), ~self.costs.whole[:, None]),
             (STAGE_TERMS.index("backward_weight"), True)]
        for g, ok in enumerate(allowed):
            least = self.least[g]
            if self.own[g] or not (ok & (least > 0) & np.isfinite(least)).any():
                continue
            table = self.rows[g].copy()
            np.add(table[backward], least, out=table[backward], where=np.isfinite(least))
            for term, rows in parts:
                np.add(table[term], least, out=table[term], where=np.isfinite(least) & rows)
            self.rows[g], self.own[g] = table, True

    def allow(self, allowed: List[np.ndarray]) -> None:
        self.allowed, self.band = allowed, Band(self.rows, allowed, nonzero=self.nonzero)
        # window[g][a] = (first, last + 1): the ends e of stage g = [a, e) that are allowed lie in it (a
        # node reads only those columns; first = last + 1 = 0 where none is)
        self.window = []
        for ok in allowed:
            any_end = ok.any(axis=1)
            first = np.where(any_end, ok.argmax(axis=1), 0)
            stop = np.where(any_end, ok.shape[1] - ok[:, ::-1].argmax(axis=1), 0)
            self.window.append(np.stack([first, stop], axis=1))

    def _memory(self, memory, costs, least, deadline) -> List[np.ndarray]:
        """fits[g][a, e]: stage g = [a, e) fits its device with nothing else on it
        (planner.cost.model.device_memory; exact with one stage per device), with some recomputation
        where `least` (R_g) is given."""
        valid = np.isfinite(range_matrix(costs.P))
        fits = []
        for g in range(self.S):
            check_deadline(deadline)
            if least is not None:
                fits.append(valid & np.isfinite(least[g]))
            else:
                fits.append(valid if memory.cap(g) is None else valid & (memory.matrix(g) <= memory.cap(g)))
        return fits


class Forms:
    """The forms as arrays: the constants c_k and per stage g a coefficient matrix (forms x terms)."""

    def __init__(self, terms: StageTerms, message_s: float):
        self.terms, self.message_s = terms, message_s
        self.constant = np.zeros(0)
        self.coefficients = np.zeros((terms.S, 0, len(STAGE_TERMS)))  # [g, k, term]
        self.completion = np.zeros((0, terms.S + 1, terms.L + 1))  # D[k, g, a]
        self.known: Set[PathForm] = set()
        # the stage floors' bound (planner.solve.floors): H_g(a, e) per stage, M[g, a], and the split attaining M
        self.floors: Optional[List[np.ndarray]] = None
        self.floored = 0  # the forms the floors count (the first ones)
        self.least = np.full((terms.S + 1, terms.L + 1), -np.inf)
        self.least_split: Optional[Tuple[int, ...]] = None
        self.refresh_s = 0.0  # how long the last refresh took
        self.deadline: Optional[float] = None  # a refresh past it gives up (time.perf_counter())

    def __len__(self) -> int:
        return len(self.constant)

    def add(self, form: PathForm, complete: bool = True) -> bool:
        """Take a form (False if known, guarded by a tie, or with a term of no stage); without
        `complete`, its completions wait for the next refresh (0 until then: every term is a
        duration, so no completion is below 0)."""
        if form in self.known or form.crossings:
            return False
        S = self.terms.S
        per_stage = np.zeros((S, 1, len(STAGE_TERMS)))
        constant = 0.0
        on_rank = stages_on_ranks(self.terms.ranks)
        for term, n in form.count().items():
            if term == ("message",):
                constant += n * self.message_s
                continue
            parts = term_parts(term, S, on_rank)
            if parts is None:
                return False
            for g, t in parts:
                per_stage[g, 0, t] += n
        self.known.add(form)
        self.constant = np.append(self.constant, constant)
        self.coefficients = np.concatenate([self.coefficients, per_stage], axis=1)
        completion = self._completion(per_stage[:, 0, :]) if complete else np.zeros(self.completion.shape[1:])
        self.completion = np.concatenate([self.completion, completion[None]])
        return True

    def add_combination(self, lam: np.ndarray) -> None:
        """Take sum_k lam_k form_k (lam >= 0, sum 1: planner.solve.dual) as one more form; it is
        no path, so it joins the bound and not `known`."""
        self.add_weighted(float(lam @ self.constant), np.einsum("k,gkt->gt", lam, self.coefficients))

    def add_weighted(self, constant: float, per_stage: np.ndarray) -> None:
        """Take constant + sum_g per_stage[g] . t_g, a convex combination of paths (one of known forms,
        or planner.solve.flow_bound's flow through every path), as one more form of the bound."""
        self.constant = np.append(self.constant, constant)
        self.coefficients = np.concatenate([self.coefficients, per_stage[:, None, :]], axis=1)
        self.completion = np.concatenate([self.completion, self._completion(per_stage)[None]])

    def refresh(self, target: float, rounds: int = FLOOR_ROUNDS) -> bool:
        """Re-derive the allowed stages for `target`, every form's completions over them, and the stage
        floors; a range whose floor reaches the target is dropped and the completions follow (`rounds`
        times at most). False where the deadline passed first (the tables from before are kept)."""
        started, kept = time.perf_counter(), self._tables()
        try:
            self._refresh(target, rounds)
            done = True
        except OutOfTime:
            self._restore(kept)
            done = False
        self.refresh_s = time.perf_counter() - started
        return done

    def probe(self, target: float, rounds: int = PROBE_ROUNDS) -> Optional[float]:
        """A bound of every split from the floors for a lower `target` than the search's: a split faster
        than `target` has every stage allowed for it, so its step is at least M[0, 0] over the ranges
        allowed then; every split's step is at least min(target, that M). As the target falls more
        ranges drop and M rises, so the best such bound lies where M meets the target
        (planner.solve.branch's `_probed_bound` seeks it). The allowed stages and the tables are put
        back after (a probe above this one must start from them); None past the deadline."""
        terms = self.terms
        allowed, kept = (terms.allowed, terms.band, terms.window), self._tables()  # a restriction makes new ones
        try:
            if not self.refresh(target, rounds):
                return None
            return min(target, float(self.least[0, 0]))
        finally:
            terms.allowed, terms.band, terms.window = allowed
            self._restore(kept)

    def _tables(self):
        """The completions, floors and M as they are (a refresh past the deadline puts them back)."""
        return self.completion, self.floors, self.floored, self.least, self.least_split

    def _restore(self, kept) -> None:
        """Past the deadline: the tables from before the refresh. They still bound every split: taken
        over a superset of the ranges allowed now (the target only falls), with the same forms or fewer."""
        self.completion, self.floors, self.floored, self.least, self.least_split = kept

    def _least(self) -> None:  # M and the split attaining it, from the floors of every form counted so far
        self.floored = len(self)
        self.least, ends = least_largest(self.floors)
        self.least_split = split_of(ends) if np.isfinite(self.least[0, 0]) else None

    def extend(self, target: float) -> None:
        """The floors for the same target with the forms added since the last refresh: their floors
        joined to the kept ones, which still hold (taken over a superset of the ranges allowed now, with
        fewer forms), the ranges whose floor reaches the target dropped, M again. A refresh where there
        are no floors to extend. Its time is not the next refresh's estimate (`refresh_s` stays)."""
        if self.floors is None:
            self.refresh(target)
            return
        kept = self._tables()
        try:
            terms, new = self.terms, slice(self.floored, len(self))
            terms.restrict(self.known, target, self.deadline)
            if new.start < new.stop:
                fresh = stage_floors(self.constant[new], self.coefficients[:, new], terms.band,
                                     self.completion[new], self.deadline)
                self.floors = [np.maximum(old, floor) for old, floor in zip(self.floors, fresh)]
            self.floors = [np.where(allowed, floor, np.inf) for allowed, floor in zip(terms.allowed, self.floors)]
            self._drop_reached(target)
            self._least()
        except OutOfTime:
            self._restore(kept)

    def _refresh(self, target: float, rounds: int = FLOOR_ROUNDS) -> None:
        terms, deadline = self.terms, self.deadline
        terms.restrict(self.known, target, self.deadline)
        self.completion = form_completions(self.coefficients, terms.band, deadline)
        if not len(self):
            return
        for _ in range(rounds):  # the floors over a superset of the final allowed stages still hold
            self.floors = stage_floors(self.constant, self.coefficients, terms.band, self.completion, deadline)
            if not self._drop_reached(target):
                break
            self.completion = form_completions(self.coefficients, terms.band, deadline)
        self._least()

    def _drop_reached(self, target: float) -> bool:
        """Drop the allowed ranges whose floor reaches the target; whether any was."""
        terms = self.terms
        kept = [allowed & (floor < target) for allowed, floor in zip(terms.allowed, self.floors)]
        if all((k == a).all() for k, a in zip(kept, terms.allowed)):
            return False
        terms.allow(kept)
        return True

    def floor_bound(self, g: int, a: int, ends: slice = slice(None)) -> np.ndarray:
        """Over e in `ends`: no split with stage g = [a, e) is faster than max(H_g(a, e), M[g + 1, e])
        (+inf where the stage is not allowed, once there are floors)."""
        if self.floors is None:
            return self.least[g + 1, ends]
        return np.maximum(self.floors[g][a, ends], self.least[g + 1, ends])

    def stage_value(self, forms: slice, g: int, a: int, ends: slice = slice(None), masked: bool = True) -> np.ndarray:
        """V_kg(a, e) for the forms in `forms` and every e in `ends` (all by default): (forms, ends),
        +inf where stage g = [a, e) is not allowed (with `masked`; else any number there)."""
        out = self.coefficients[g, forms] @ self.terms.rows[g][:, a, ends]
        return np.where(self.terms.allowed[g][a][None, ends], out, np.inf) if masked else out

    def _completion(self, per_stage: np.ndarray) -> np.ndarray:
        """D[g, a] for one form (per_stage[g]: its counts of stage g's terms): its least sum over the
        splits of [a, L) into stages g..S-1."""
        return form_completions(per_stage[:, None, :], self.terms.band)[0]


def form_prefix(known: Forms, forms: slice, cuts: Sequence[int]) -> np.ndarray:
    """c_k + sum over the fixed stages of V_kh, for the forms in `forms`."""
    total = np.array(known.constant[forms], dtype=float)
    a = 0
    for h, e in enumerate(cuts):
        total = total + known.stage_value(forms, h, a)[:, e]
        a = e
    return total
