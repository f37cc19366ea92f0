"""The replicated-stage search's tables (planner.solve.replicas, whose docstring states the problem,
the fill-drain form and the bounds): per (replicas r, devices k from the stage to the end) each
range's stage time T' (compute, transfers and the recomputation that makes it fit), X and E, with
the held counts and messages bounded over every suffix (`ReplicaTables`) or exact for one replica
tuple (`TupleTables`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from planner.cost.model import cut_times, num_micro_batches, rank_caps, stage_call_s, static_bytes, sync_time
from planner.cost.options import CostOptions
from planner.cost.ranges import prefix_sums, range_costs, range_matrix
from planner.pipeline.schedule import build_schedule, last_stage_warmup, warmup_before
from planner.pipeline.stepgraph import held_peaks
from planner.profile.profile import Profile
from planner.solve.chain_recompute import recompute_range_tables
from planner.solve.floors import check_deadline


@dataclass
class ReplicaSplit:
    """A replicated plan's shape: where the stages are cut, and each stage's replica count."""

    boundaries: List[int]
    replicas: List[int]

def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def replica_tuples(devices: int, stages: int, largest: int):
    """Every tuple of `stages` replica counts in 1..largest summing to `devices`."""
    if stages == 1:
        if 1 <= devices <= largest:
            yield (devices,)
        return
    for first in range(1, min(largest, devices - stages + 1) + 1):
        for rest in replica_tuples(devices - first, stages - 1, largest):
            yield (first,) + rest


def replicates_running_stats(profile: Profile, boundaries: List[int], replicas: Tuple[int, ...]) -> bool:
    """Whether a stage with more than one replica holds a unit writing state in its forward
    (planner.model.running_stats: such a stage is never replicated)."""
    ends = [0, *boundaries, profile.num_units]
    return any(r > 1 and any(u.running_stats for u in profile.units[a:e])
               for r, a, e in zip(replicas, ends, ends[1:]))


def suffix_warmups(devices: int, max_r: int, pick) -> Dict[Tuple[int, int], int]:
    """The 1f1b warm-up w_g of a stage with r replicas and k devices from it to the end, by the
    schedule's rule (planner.pipeline.schedule: `last_stage_warmup`, `warmup_before`), maximised
    (pick=max) or minimised (pick=min) over every suffix after it. The DP's state (first unit,
    devices left) does not know the suffix: the largest warm-up gives plans that fit whatever
    follows, the smallest a lower bound."""
    table: Dict[Tuple[int, int], int] = {}
    for k in range(1, devices + 1):
        for r in range(1, min(k, max_r) + 1):
            if k == r:
                table[r, k] = last_stage_warmup(r)
            else:
                table[r, k] = pick(warmup_before(table[q, k - r], r, q) for q in range(1, min(k - r, max_r) + 1))
    return table


class _Lazy(dict):
    """key -> value made on first reading (`make(*key)`): the memory tables, which nothing reads
    without a cap but the diagnosis of a search that found no plan."""

    def __init__(self, make) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key):
        value = self[key] = self._make(*key)
        return value


class ReplicaTables:
    """Per (r, k): the stage time T' (T plus the recomputation that makes the stage fit, +inf where
    nothing fits), X = (ceil(m / r) - 1) T' and E_r, at one micro-batch size; the DPs on them.

    recompute_bound ('auto' under a cap only): 'lower' adds the fractional-knapsack recomputation
    time (planner.solve.chain_recompute), a lower bound on every plan; 'upper' the greedy whole-unit
    one, which is a feasible plan's. deadline (time.perf_counter()): building the tables and each DP
    stop past it (planner.solve.floors.OutOfTime; at 1,251 units a table is 1,252^2 values, and
    one DP reads one per (r, k)). Tables that do not depend on the held count (no cap) are one
    array shared by every (r, k) with the same value, and the memory tables are made when read."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, devices: int,
                 recompute_bound: Optional[str] = None, held_bound: str = "upper",
                 deadline: Optional[float] = None) -> None:
        self.deadline = deadline
        costs, L, params, trainable, acts = self._common(profile, b, opts, devices)
        cap = rank_caps(opts, profile)[0]  # no cluster: one cap
        # messages held (planner.pipeline.stepgraph.held_peaks): each of a replica device's H = ceil(m / r)
        # micro-batches is, at any moment, in one state: received and not yet forwarded (in_a) or
        # backwarded with its input gradient posted (grad_a): at most `before`; or live (at most `held`
        # of them), its output posted or its gradient received (act_e or grad_e, never both): at most
        # A + `after`; or none. Under 'upper' the largest such sum (every plan found fits), none under 'lower'
        message = np.maximum(costs.act, costs.grad)  # 0 at both ends: the first stage receives nothing
        before, after = message[:, None], message[None, :]
        warmups = suffix_warmups(devices, self.max_r, max if held_bound == "upper" else min)
        unreplicable = range_matrix(prefix_sums(u.running_stats for u in profile.units)) > 0
        stateful = bool(unreplicable.any())
        unreplicated_T: Optional[np.ndarray] = None  # T without the ranges that hold running statistics

        def parts(held: int, r: int):
            """(static bytes [a, e], micro-batches per replica device H, the held messages' bytes or None)."""
            static = static_bytes(params, trainable, opts, profile.dtype, r * opts.data_parallel)
            H = ceil_div(self.m, r)  # linear in the live count: its largest at held or 0
            return static, H, (held * after + (H - held) * before if held_bound == "upper" else None)

        def memory(held: int, r: int) -> np.ndarray:
            static, H, messages = parts(held, r)
            return static + held * acts if messages is None else \
                static + np.maximum(held * acts + messages, H * before)
        self.memory = _Lazy(memory)
        shared: Dict[Tuple[int, int], np.ndarray] = {}  # (id of T', ceil(m / r) - 1) -> X: one array per value
        for k in range(1, devices + 1):
            for r in range(1, min(k, self.max_r) + 1):
                check_deadline(deadline)
                window = self.m if opts.schedule == "gpipe" else min(warmups[r, k] + 1, self.m)
                held = self.held[r, k] = ceil_div(window, r)
                key = (held, r)
                if key not in self.fits:
                    if recompute_bound is not None:
                        static, H, messages = parts(held, r)
                        low, high = recompute_range_tables(profile, b, opts, held, holders=r * opts.data_parallel,
                                                           extra=messages if recompute_bound == "upper" else None,
                                                           deadline=deadline)
                        if recompute_bound == "upper":  # what no recomputation frees must fit too
                            high = np.where(static + H * before <= cap, high, np.inf)
                        fits = self.T + (low if recompute_bound == "lower" else high)
                    elif cap is None:  # the same T for every held count
                        fits = self.T
                    else:
                        fits = np.where(self.memory[key] <= cap, self.T, np.inf)
                    if r > 1 and stateful:  # a range with running statistics is never replicated
                        if fits is self.T:  # (planner.model.running_stats): one array for every such r
                            if unreplicated_T is None:
                                unreplicated_T = np.where(unreplicable, np.inf, self.T)
                            fits = unreplicated_T
                        else:
                            fits = np.where(unreplicable, np.inf, fits)
                    self.fits[key] = fits
                if (r, held) not in self._x:
                    t, times = self.fits[key], ceil_div(self.m, r) - 1
                    if (id(t), times) not in shared:
                        shared[id(t), times] = np.where(np.isfinite(t), times * np.where(np.isfinite(t), t, 0.0),
                                                        np.inf)
                    self._x[r, held] = shared[id(t), times]

    def _common(self, profile: Profile, b: int, opts: CostOptions, devices: int):
        """T, E and the dimensions; (costs, L, parameter bytes, trainable bytes, saved bytes) [a, e]."""
        check_deadline(self.deadline)
        costs, L = range_costs(profile, b), profile.num_units
        self.L, self.N, self.m = L, devices, num_micro_batches(opts, b)
        redo_all = opts.recompute == "all"
        work = range_matrix(costs.work_prefix(redo_all))
        cuts = np.array(cut_times(profile, b, opts) + [0.0])  # one link: no cluster
        ends = np.arange(L + 1)
        self.T = work + stage_call_s(profile, b) + np.where(ends > 0, cuts, 0.0)[:, None] + \
            np.where(ends < L, cuts, 0.0)[None, :]
        params, trainable, regathered = range_matrix(costs.P), range_matrix(costs.T), range_matrix(costs.FB)
        acts = costs.saved_matrix(redo_all)
        self.max_r = min(devices, self.m)
        finite = np.isfinite(self.T)
        exchanged = tuple(np.where(finite, x, 0.0) for x in (params, trainable, regathered))
        self.E = {}
        for r in range(1, self.max_r + 1):
            check_deadline(self.deadline)
            self.E[r] = np.where(finite, sync_time(*exchanged, opts, profile.dtype, self.m, r * opts.data_parallel),
                                 np.inf)
        self.held: Dict[Tuple[int, int], int] = {}  # (r, k) -> micro-batches held per replica device
        self.memory: Dict[Tuple[int, int], np.ndarray] = {}  # (held, r) -> M[a, e] without recomputation
        self.fits: Dict[Tuple[int, int], np.ndarray] = {}  # (held, r) -> T'[a, e]
        self._x: Dict[Tuple[int, int], np.ndarray] = {}  # (r, held) -> X[a, e]
        return costs, L, params, trainable, acts

    def recompute_need(self, r: int, k: int, a: int, e: int, cap: float) -> Tuple[float, int]:
        """(bytes to free, micro-batches held) of stage [a, e) with r replicas and k devices from it
        to the end: what `cheapest_recompute` covers."""
        held = self.held[r, k]
        return float(self.memory[held, r][a, e]) - cap, held

    def base(self, r: int, k: int) -> np.ndarray:
        """T'[a, e] of stage [a, e) with r replicas and k devices from it to the end."""
        return self.fits[self.held[r, k], r]

    def X(self, r: int, k: int) -> np.ndarray:
        return self._x[r, self.held[r, k]]

    def Ek(self, r: int, k: int) -> np.ndarray:
        return self.E[r]

    def _dp(self, table, combine) -> Tuple[float, Optional[ReplicaSplit]]:
        """best_k(a) = min over (e, r) of combine(table(r, k)[a, e], best_{k-r}(e)); the plan of best_N(0)
        (of best_N only its row a = 0). OutOfTime past the tables' deadline."""
        L, rows = self.L, np.arange(self.L + 1)
        best = [np.where(rows == L, 0.0, np.inf)]
        arg_e, arg_r = [None], [None]
        for k in range(1, self.N + 1):
            check_deadline(self.deadline)
            n = 1 if k == self.N else L + 1  # all N devices from unit a on: a = 0 alone
            cur, ce, cr = np.full(n, np.inf), np.zeros(n, dtype=int), np.zeros(n, dtype=int)
            for r in range(1, min(k, self.max_r) + 1):
                cand = combine(table(r, k)[:n], best[k - r][None, :])
                e = np.argmin(cand, axis=1)
                val = cand[rows[:n], e]
                better = val < cur
                cur, ce, cr = np.where(better, val, cur), np.where(better, e, ce), np.where(better, r, cr)
            best.append(cur)
            arg_e.append(ce)
            arg_r.append(cr)
        if not math.isfinite(best[self.N][0]):
            return math.inf, None
        bounds, reps, a, k = [], [], 0, self.N
        while a < L:
            e, r = int(arg_e[k][a]), int(arg_r[k][a])
            bounds.append(e)
            reps.append(r)
            a, k = e, k - r
        return float(best[self.N][0]), ReplicaSplit(bounds[:-1], reps)

    def min_sum(self, tau: float = math.inf, eps: float = math.inf) -> Tuple[float, Optional[ReplicaSplit]]:
        """g(tau, eps): least sum T' with every X <= tau and E <= eps."""
        cache: Dict[Tuple[int, int, int], np.ndarray] = {}

        def table(r, k):  # one per distinct (X, E, T') arrays: the tables share them where they are equal
            key = (id(self.X(r, k)), id(self.E[r]), id(self.base(r, k)))
            if key not in cache:
                cache[key] = np.where((self.X(r, k) <= tau) & (self.E[r] <= eps), self.base(r, k), np.inf)
            return cache[key]
        return self._dp(table, np.add)

    def min_max(self, which) -> Tuple[float, Optional[ReplicaSplit]]:
        """Least max over stages of which(r, k) (self.X or self.Ek) among memory-feasible plans."""
        return self._dp(lambda r, k: np.where(np.isfinite(self.base(r, k)), which(r, k), np.inf), np.maximum)

    def min_memory(self) -> Tuple[float, Optional[ReplicaSplit]]:
        """Least max per-device memory of any plan on N devices under these tables (caps ignored;
        with the 'upper' buffers a memory in which the plan surely fits)."""
        return self._dp(lambda r, k: self.memory[self.held[r, k], r], np.maximum)

    def values(self, plan: ReplicaSplit) -> Tuple[float, float, float]:
        """(sum T', max X, max E) of a plan, read from the tables."""
        edges, reps = [0] + list(plan.boundaries) + [self.L], plan.replicas
        parts = [(self.base(r, k)[a, e], self.X(r, k)[a, e], self.E[r][a, e])
                 for a, e, r, k in zip(edges, edges[1:], reps, [sum(reps[g:]) for g in range(len(reps))])]
        return float(sum(p[0] for p in parts)), float(max(p[1] for p in parts)), float(max(p[2] for p in parts))

    def candidates(self, which) -> np.ndarray:
        """The values which(r, k) (X or E) takes where a stage fits, ascending (each distinct pair of
        arrays read once)."""
        pairs = {}
        for (r, k) in self.held:
            values, base = which(r, k), self.base(r, k)
            pairs.setdefault((id(values), id(base)), (values, base))
        return np.unique(np.concatenate([values[np.isfinite(base)] for values, base in pairs.values()]))

class TupleTables(ReplicaTables):
    """The tables of one replica tuple (r_0, .., r_{S-1}) with each stage's exact memory: the runtime's
    lists of that tuple (planner.pipeline.schedule.build_schedule) give every device's held peaks
    (planner.pipeline.stepgraph.held_peaks), so a stage's memory over [a, e) is the cost model's,

        M_g[a, e] = static_{r_g}[a, e] + max_p (live_p A[a, e] + inbox_p act_a + sent_grad_p grad_a
                                               + gradbox_p grad_e + sent_act_p act_e),

    p over the peaks of its devices. (r, k) pairs off the tuple are +inf, so the DPs and the search
    of ReplicaTables run on the tuple alone and every plan they find fits (recomputation 'auto':
    the greedy whole-unit cover of the bytes each held micro-batch must free for every peak)."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, replicas: Tuple[int, ...],
                 deadline: Optional[float] = None) -> None:
        self.deadline = deadline
        costs, L, params, trainable, acts = self._common(profile, b, opts, sum(replicas))
        cap = rank_caps(opts, profile)[0]
        auto = opts.recompute == "auto" and cap is not None
        lists = build_schedule(opts.schedule, len(replicas), self.m, stage_replicas=list(replicas))
        unreplicable = range_matrix(prefix_sums(u.running_stats for u in profile.units)) > 0
        act, grad = costs.act, costs.grad
        into, out = act[:, None], act[None, :]  # act_a, act_e
        grad_in, grad_out = grad[:, None], grad[None, :]
        nothing, zero = np.full((L + 1, L + 1), np.inf), np.zeros((L + 1, L + 1))
        for k in range(1, self.N + 1):
            for r in range(1, min(k, self.max_r) + 1):
                self.held[r, k] = -1
        self.targets: Dict[int, np.ndarray] = {}
        device = 0
        for g, r in enumerate(replicas):
            check_deadline(deadline)
            k = sum(replicas[g:])
            static = static_bytes(params, trainable, opts, profile.dtype, r * opts.data_parallel)
            peaks = [p for lst in lists[device:device + r] for p in held_peaks(lst)]
            device += r
            terms = []  # (live, the messages' bytes [a, e])
            for p in peaks:
                count = {name: n for (name, stage), n in p.items() if stage == g}
                terms.append((count.get("live", 0), zero + count.get("inbox", 0) * into + count.get("sent_grad", 0) *
                              grad_in + count.get("gradbox", 0) * grad_out + count.get("sent_act", 0) * out))
            held = -2 - g  # a key of its own per stage
            self.held[r, k] = held
            none = -nothing  # -inf: the identity of the maxima below
            memory = static + np.max([none] + [(live * acts if live else 0.0) + msgs for live, msgs in terms], axis=0)
            self.memory[held, r] = memory = np.maximum(memory, static)  # no peak: nothing held
            if auto:  # for every peak: live (A - freed) + messages <= cap - static
                room = cap - static
                hard = np.max([none] + [msgs for live, msgs in terms if live == 0], axis=0)
                target = np.max([none] + [acts + (msgs - room) / live for live, msgs in terms if live > 0], axis=0)
                target = np.where(hard <= room, target, np.inf)
                self.targets[held] = target
                _, high = recompute_range_tables(profile, b, opts, 1, holders=r * opts.data_parallel, target=target,
                                                 deadline=deadline)
                fits = self.T + high
            elif cap is None:
                fits = self.T
            else:
                fits = np.where(memory <= cap, self.T, np.inf)
            if r > 1:
                fits = np.where(unreplicable, np.inf, fits)
            self.fits[held, r] = fits
            self._x[r, held] = np.where(np.isfinite(fits), (ceil_div(self.m, r) - 1) *
                                        np.where(np.isfinite(fits), fits, 0.0), np.inf)
        for (r, k), held in list(self.held.items()):
            if held == -1:
                self.memory[-1, r] = self.fits[-1, r] = self._x[r, -1] = nothing

    def recompute_need(self, r: int, k: int, a: int, e: int, cap: float) -> Tuple[float, int]:
        held = self.held[r, k]
        if held in self.targets:
            return float(self.targets[held][a, e]), 1
        return float(self.memory[held, r][a, e]) - cap, 1
