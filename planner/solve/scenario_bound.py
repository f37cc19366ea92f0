"""A scenario's lower bound: what no split of one scenario (p, d, schedule, v, micro-batch b) can beat
under the exact model, cheap enough to rate every scenario before any search (planner.solve.search
skips those whose bound is not below its best plan, and counts it for those it does not reach):

    v = 1:  min over splits of max_g  W(0, a_g) / sigma_max + m (k + W(a_g, e_g) + R_g(a_g, e_g)) / sigma_g
                                      + max(0, W(e_g, L) / sigma_max - (m - 1) F_g)
            (stage g's rank runs m forwards and backwards (a replicated stage's busiest replica
            ceil(m / r_g), and m above reads so), after micro-batch 0 crossed the stages
            before it and before the last micro-batch's backward crosses them again; between the
            forward and the backward of the first micro-batch it backwards, that micro-batch
            crosses every later stage and back, while the rank runs c_g other forwards (F_g = (k^f +
            F(a_g, e_g)) / sigma_g each; c_g read from its list: 1F1B's warm-up, GPipe's m - 1) to fill the
            wait; an exact min-max partition).
            The crossings count too: each boundary before g (after g) costs at least its cheapest
            message pair at a cut left of a_g (right of e_g); the rank's own batches between its first
            forward and last backward (the cost per message of each) can fill the wait: the larger counts.
            Where larger, a stage's term is B_g(a_g, e_g) + O_g(a_g, e_g) + m R_g / sigma_g instead: its rank's
            own computes, its blocking batches' waits at the stage's cuts (planner.solve.rank_busy) and its
            optimizer step O_g (none where weights are tied); or its span: the fill and drain as above, every
            compute, the waits of the batches between its first and last compute, and max(0, the first wait
            less the c_g forwards and the waits of the batches run meanwhile).
            Under a memory cap R_g is +inf where the range never fits its device (no stage holds it) and,
            under `--recompute auto` with 1F1B, GPipe or zb-h1, the least recomputation it needs to fit
            (planner.solve.recompute_bound; 0 otherwise)
    v > 1:  max( (m (W + S k) / sigma_max + min over cuts sum_g waits_g + O(0, L) / sigma_max) / p,
                 (W + S k) / sigma_max,  min over splits of max_g B_g(a_g, e_g) + O_g(a_g, e_g),
                 the ranks' spans (planner.solve.rank_span) )
            (the busiest rank, one micro-batch, the busiest stage's rank, each rank's fill, work and drain)

plus the step overhead (W: the units' forward and backward work, with the recomputed forward under
'all'). Zero-bubble schedules: W counts both backward parts (and a recomputed forward in each), while
the crossing after a stage and the one micro-batch of v > 1 count forward and input backward only
(nothing waits for a weight backward), the one before it forwards only, with only the activation
messages of the boundaries before it (its last weight backwards may overlap the input backwards
and the gradient messages upstream).

Past its deadline each part gives way to a looser one that still holds.
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from planner.cost.model import num_micro_batches, rank_speeds
from planner.cost.options import CostOptions
from planner.cost.ranges import prefix_sums, range_costs
from planner.pipeline.schedule import ZERO_BUBBLE_SCHEDULES
from planner.profile.profile import Profile
from planner.solve.diagnose import min_max_partition
from planner.solve.floors import OutOfTime, check_deadline
from planner.solve.rank_busy import CutWaits, crossings_before, rank_busy
from planner.solve.rank_span import least_work, rank_span_bound

# the one-stage-per-device bound's operations on (L + 1)^2 arrays after its first: a few before the
# stages' partition, then each stage's matrix and its step of the partition (scenario_lower_bound)
BOUND_MATRIX_OPERATIONS, BOUND_MATRIX_OPERATIONS_PER_STAGE = 12, 19


def scenario_lower_bound(profile: Profile, b: int, opts: CostOptions, deadline: Optional[float] = None) -> float:
    """A lower bound of every plan's iteration time in the scenario (module docstring). With one stage
    per device the least over splits of the stages' own bounds, O(S L^2); past `deadline`
    (time.perf_counter()) the bound of several stages per device instead, which holds for every schedule."""
    costs = range_costs(profile, b, opts.optimizer)
    m, S, p = num_micro_batches(opts, b), opts.num_stages, opts.pipeline_ranks
    speeds = rank_speeds(opts)
    fastest = max(speeds)
    redo = costs.AGAIN if opts.recompute == "all" else 0.0
    L = profile.num_units
    call = costs.call_forward + costs.call_backward
    if opts.schedule in ZERO_BUBBLE_SCHEDULES:  # planner.cost.ranges: the parts of a later and of the first stage
        # what one micro-batch's crossing waits for, past the first stage (recomputed forwards run in both
        # parts); a unit a stage whose input part runs nothing may hold (one starting at or before it at a
        # cut no gradient crosses, ranges' `whole`) adds nothing to it
        redo_l = costs.again if opts.recompute == "all" else np.zeros(L)
        whole_from = next((a for a in range(1, L) if costs.whole[a]), L)
        crossing_part = np.where(np.arange(L) < whole_from, costs.gi + redo_l, 0.0)
        chain = costs.F + prefix_sums(crossing_part)
        lead = costs.F  # before a rank's first forward; its last W's may overlap the I's upstream

        def work_matrix() -> np.ndarray:  # (L + 1)^2: made only where read
            parts = costs.split_matrices(redo)
            return costs.matrix(costs.F) + costs.call_forward + parts[0] + parts[1]
        # v > 1: the first stage (units [0, e), e <= L - S + 1) is unknown, so each unit its cheaper
        # case; the chain counts only the units no first stage holds
        least, least_call = least_work(costs, opts)
        wholes = 1 if whole_from == L else S  # the stages that may split as the first one does
        total = float(least[-1]) + wholes * least_call + \
            (S - wholes) * (costs.call_forward + costs.later_input + costs.later_weight)
        through = float(costs.F[-1] + crossing_part[L - S + 1:].sum()) + S * costs.call_forward + \
            wholes * min(costs.first_input, costs.later_input) + (S - wholes) * costs.later_input
    else:
        prefix = chain = costs.F + costs.G + redo
        lead = prefix

        def work_matrix() -> np.ndarray:
            return costs.matrix(prefix) + call
        total = float(prefix[-1]) + S * call
        through = float(chain[-1]) + S * call
    loose = max(m * total / (p * fastest), through / fastest)  # the busiest rank's share; one micro-batch's chain
    # each rank's optimizer step after its list (planner.pipeline.stepgraph), over its units; none where weights
    # are tied (a rank's copies of a tie fewer than its units count)
    optimizer = np.zeros(L + 1) if profile.extra.get("shared_parameters") else costs.O
    cut_busy = None  # planner.solve.rank_busy: per stage, what its rank's blocking batches wait at its cuts
    if not opts.replicated and (deadline is None or time.perf_counter() < deadline):  # (reads the lists)
        cut_busy = CutWaits(rank_busy(opts, m), costs, opts, L)
        loose = max(loose, (m * total / fastest + cut_busy.least_sum() + optimizer[-1] / fastest) / p)
    if deadline is None or time.perf_counter() < deadline:
        made = time.perf_counter()
        forward = costs.matrix(costs.F) + costs.call_forward
        # the loose bound where the (L + 1)^2 operations still to come, each about as long as this one
        # (0.5 s at 10,000 units), would end past the deadline
        still = BOUND_MATRIX_OPERATIONS + BOUND_MATRIX_OPERATIONS_PER_STAGE * S
        if deadline is not None and time.perf_counter() + (time.perf_counter() - made) * still > deadline:
            return loose + opts.step_overhead_s
        work = work_matrix()
        if opts.virtual_stages > 1:  # each stage's rank: its own computes and waits at its cuts
            busiest = _busiest_stage(m * work + costs.matrix(optimizer), cut_busy, L, S, deadline) \
                if cut_busy is not None else 0.0
            spans = rank_span_bound(costs, opts, m, L, deadline) if cut_busy is not None else 0.0
            return max(loose, busiest, spans) + opts.step_overhead_s
        forward = np.where(np.isfinite(forward), forward, 0.0)  # e <= a: +inf comes from `work`
        # crossing boundary j at cut position c: both messages' transfers and the cost per message;
        # under zero bubble only the activation's precedes the rank (the gradients going back up may
        # overlap its own weight backwards, as `lead` says)
        zero_bubble = opts.schedule in ZERO_BUBBLE_SCHEDULES

        # the boundaries before stage g lie at cuts <= a_g, those from g on at cuts >= e_g
        fill = crossings_before(costs, opts, ("act",) if zero_bubble else ("act", "grad"))
        drain = crossings_before(costs, opts, ("act", "grad"), after=True)
        fill, drain = np.where(np.isfinite(fill), fill, 0.0), np.where(np.isfinite(drain), drain, 0.0)
        before = lead[:, None] / fastest
        after = (chain[-1] - chain)[None, :] / fastest

        scaled = {}  # (speed, micro-batches) -> (their work, forward, step) at that speed: shared by its stages
        steps = costs.matrix(optimizer) if cut_busy is not None else None  # (read with the rank's waits)
        runs = stage_runs(opts, m)

        def filling(g: int) -> int:  # the forwards that may fill stage g's wait: from its rank's list
            return cut_busy.busy.filling[g] if cut_busy is not None else runs[g] - 1
        if cut_busy is not None:
            middle = CutWaits(rank_busy(opts, m, "between_computes"), costs, opts, L)
            first_wait = CutWaits(rank_busy(opts, m, "first_wait"), costs, opts, L)
        try:
            fitting = _fitting_terms(profile, b, opts, deadline)
        except OutOfTime:
            fitting = None

        def stage(g: int) -> np.ndarray:
            # the rank's own batches between its first forward and its last backward (every message
            # but its first receive and its last send) may lie in the wait: the larger counts
            n = runs[g]  # a replicated stage: its busiest replica's micro-batches
            inside = ((g < S - 1) * 2 * n + (g > 0) * (2 * n - 2)) * opts.message_s
            if (speeds[g], n) not in scaled:
                scaled[(speeds[g], n)] = (n * work / speeds[g], forward / speeds[g],
                                          None if steps is None else steps / speeds[g])
            busy, one_forward, step = scaled[(speeds[g], n)]
            overlapped = filling(g) * one_forward
            value = np.subtract(after + drain[g][None, :], overlapped)  # in place below: L^2 each
            np.maximum(value, inside, out=value)
            value += busy
            value += before + fill[g][:, None]
            if cut_busy is not None:  # or its rank's computes, its batches' waits at its cuts and its step
                np.maximum(value, cut_busy.add_to(busy + step, g), out=value)
                # or its span: the fill, every compute and the waits of the batches between its first and
                # last, the drain, and what of the wait for its first backward's micro-batch the forwards
                # and batches run meanwhile (`first_wait`) leave
                span = first_wait.add_to(np.subtract(after + drain[g][None, :], overlapped), g, -1.0)
                np.maximum(span, 0.0, out=span)
                span += busy
                span += before + fill[g][:, None]
                np.maximum(value, middle.add_to(span, g), out=value)
            if fitting is not None:
                value += fitting[g]
            return value

        try:
            value = min_max_partition(profile.num_units, S, stage, deadline)[0]
        except OutOfTime:
            value = loose
    else:
        value = loose
    return value + opts.step_overhead_s


def stage_runs(opts: CostOptions, m: int) -> List[int]:
    """Per stage, the micro-batches its busiest device runs: m, or, for a stage on r_g replicas (each runs
    every r_g-th micro-batch), ceil(m / r_g)."""
    if not opts.replicated:
        return [m] * opts.num_stages
    return [-(-m // r) for r in opts.replicas]


def _busiest_stage(busy: np.ndarray, cut_busy: CutWaits, L: int, S: int, deadline: Optional[float]) -> float:
    """min over splits of max_g B_g(a_g, e_g) (planner.solve.rank_busy) plus the stage's optimizer step, `busy`
    the micro-batches' work and the step at speed 1; 0 past the deadline."""
    scaled = {}  # speed -> busy / speed, shared by the stages of ranks of that speed

    def stage(g: int) -> np.ndarray:
        speed = cut_busy.busy.speeds[g]
        if speed not in scaled:
            scaled[speed] = busy / speed
        return cut_busy.add_to(scaled[speed].copy(), g)
    try:
        return min_max_partition(L, S, stage, deadline)[0]
    except OutOfTime:
        return 0.0


def _fitting_terms(profile: Profile, b: int, opts: CostOptions, deadline: Optional[float] = None
                   ) -> Optional[List[np.ndarray]]:
    """Per stage g, what a split pays for stage g = [a, e) to fit its device (one stage per device),
    beyond its work: +inf where it never fits, and under `--recompute auto` (1F1B, GPipe, zb-h1) m times the
    least recomputation R_g(a, e) it needs (planner.solve.recompute_bound), 0 elsewhere; None where
    no device has a cap, recomputation is chosen per unit under another schedule (no such bound), or stages
    are replicated (StageMemory counts a stage on one device)."""
    from planner.cost.stage_memory import StageMemory
    from planner.solve.recompute_bound import bounded, least_recompute

    if opts.replicated:  # StageMemory counts a stage on one device (a replica holds fewer micro-batches)
        return None
    memory = StageMemory(profile, b, opts, opts.recompute == "all")
    S = opts.num_stages
    if all(memory.cap(g) is None for g in range(S)) or (opts.recompute == "auto" and not bounded(opts)):
        return None
    if opts.recompute == "auto":
        m = num_micro_batches(opts, b)
        return [m * table for table in least_recompute(memory, range_costs(profile, b, opts.optimizer), opts, b)]
    terms = []
    for g in range(S):
        check_deadline(deadline)
        cap = memory.cap(g)
        terms.append(np.zeros((profile.num_units + 1,) * 2) if cap is None else
                     np.where(memory.matrix(g) <= cap, 0.0, np.inf))
    return terms
