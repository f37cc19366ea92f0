"""The pipeline cost model: what a plan costs, in time and memory. The single source of truth.

Notation. The profile has L ordered units. A plan has p pipeline ranks (devices per replica), d
data-parallel replicas, v model stages per rank (v = 1 except for `interleaved`/`bfs`), and
C = p * v stages, stage c holding units [a_c, e_c) and running on rank c % p. The C - 1
boundaries are the cuts e_0 < ... < e_{C-2}. A global batch of G samples is G = d * m * b: each
replica runs m micro-batches of size b. R is the set of recomputed units.

Time per micro-batch of stage c on rank i = c % p (speed sigma_i, 1 without a cluster):

    F_c = (k^f + sum_{l in c} f_l) / sigma_i          B_c = (k^b + sum_{l in c} (g_l + [l in R] f_l)) / sigma_i
    (k^f, k^b: the profile's stage_overhead_s at b, what a stage pays per micro-batch whatever its
    units: one call's fixed cost; 0 for analytic and imported profiles. A recomputed unit runs as
    its own checkpointed call, whose fixed cost, up to k^f per unit in R, is not charged: an
    approximation, small beside f_l, that keeps every solver's stage time the same sum)
    t_k^j = (act_k + grad_k) / bw_j + lat_j * [act_k > 0] * (1 + [grad_k > 0])
            (cut k used as boundary j, between ranks j % p and (j + 1) % p of the path bw_j, lat_j)
    T_c = F_c + B_c + t_{a_c}^{c-1} [c > 0] + t_{e_c}^{c} [c < C - 1]

Per-iteration extra time of rank i (gradient traffic, once per iteration):

    E_i = 2 (d - 1) / d * P_i / dp_bandwidth  +  sum_{c on i} tie_c
    tie_c = sum over shared parameters t used in stage c: 2 (n_t - 1) bytes_t / bandwidth
            (n_t: number of stages holding a use of t; nothing when n_t = 1)

Iteration time (D_i = sum_{c on i} T_c, the rank's work per micro-batch):

    iteration = (1/v) sum_c T_c + (m - 1/v) max_i D_i + max_i E_i + step_overhead + (1/p) sum_l o_l

(step_overhead: a constant per iteration, e.g. from `planner calibrate`; o_l: one optimizer step
over unit l's parameters, as profiled. Each rank steps its own units' parameters once per
iteration, after its last backward; the model charges the average rank's step, (1/p) sum_l o_l,
a constant for given p: like step_overhead it moves no argmin of a fixed p but is part of every
predicted time and every bound (`CostOptions.per_step_s`). Charging max_i O_i instead would make
it a third max term in every solver; the ranks' steps differ by a few per cent of an iteration.)

For v = 1 this is the classic fill-drain bound sum_s T_s + (m - 1) max_s T_s (GPipe and 1F1B);
with equal stages of time t it is m v t + (p - 1) t: Megatron's interleaved bubble (p - 1)/(v m).
`bfs` (looped breadth-first) uses the same closed form: every stage pass streams m >= 1
micro-batches, so the fill costs one stage-row of time, (1/v) sum_c T_c, like interleaving.

Memory of rank i (bytes): M_i = sum_{c on i} [ P_c (2 + opt) + h_c A_c ] with
A_c = sum_{l in c} (in_l if l in R else s_l) (in_l: bytes crossing cut l, in_0 = 0) and h_c the
micro-batches whose activations stage c holds at once:

    gpipe: m      1f1b: min(p - c, m)      bfs: m (all micro-batches of every stage)
    interleaved (Megatron's 1F1B with v stages): rank i runs W_i = min(2 (p - i - 1) + (v - 1) p, m v)
    warm-up forwards then one more before its first backward; forward k goes to local stage
    (k // p) % v, so h_c = #{k < min(W_i + 1, m v) : (k // p) % v = c // p}.

Interleaved needs m to be a multiple of p (Megatron's rule). A plan is feasible iff M_i <= cap_i.

Replicated stages (PipeDream-style; v = 1, gpipe or 1f1b, no cluster, no tied parameters).
Stage g of S gets r_g >= 1 devices, N = sum_g r_g devices per data-parallel replica (the plan's
pipeline_stages; world size d N). Stage g runs on devices o_g .. o_g + r_g - 1, o_g = sum_{h<g} r_h,
and micro-batch i of stage g on replica i mod r_g, so one replica device processes at most
n_g = ceil(m / r_g) micro-batches; m >= max_g r_g. T_g is as above (compute + transfers). Then

    iteration = sum_g T_g + max_g (n_g - 1) T_g + max_g E_g + step_overhead + (1/N) sum_l o_l
    E_g = 2 (n - 1) / n * P_g / dp_bandwidth,  n = r_g d   (one ring over every holder of stage g)
    held per replica device:  gpipe: ceil(m / r_g)     1f1b: ceil(min(w_g + 1, m) / r_g)
    with the 1f1b warm-up of the unreplicated order that each replica filters to its micro-batches
    (planner.pipeline.schedule.one_f_one_b_warmups): w_last = r_last - 1, w_g = min(w_{g+1} + max(r_g, r_{g+1}), m)
    (r = 1 everywhere: min(p - g, m) as above).

M_g (per replica device) = P_g (2 + opt) + h_g A_g. With every r_g = 1 this is the v = 1 model
above: n_g = m and (m - 1) max_g T_g. The closed form assumes each replica streams its n_g
micro-batches; tests/solve/test_replicas.py checks it against the event simulation of the
runtime's lists (BENCHMARKS.md: how close). The warm-up grows by max(r_g, r_{g+1}) so that a wide
stage behind a narrow one does not serialise (planner.pipeline.schedule.warmup_before).
(planner/cost/replicas.py.)
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from planner.cost.options import CostOptions
from planner.cost.replicas import replica_in_flight, replicated_plan_cost
from planner.cost.result import PlanCost, StageCost
from planner.pipeline.schedule import interleaved_warmup, one_f_one_b_warmups
from planner.profile.profile import OPTIMIZER_STATE_PER_PARAM_BYTE, Profile

def optimizer_factor(optimizer: str) -> float:
    """opt: optimizer-state bytes per parameter byte."""
    return float(OPTIMIZER_STATE_PER_PARAM_BYTE[optimizer])


def num_micro_batches(opts: CostOptions, b: int) -> int:
    """m = G / (d b)."""
    return opts.global_batch // (opts.data_parallel * b)


def candidate_micro_batch_sizes(profile: Profile, global_batch: int, opts: Optional[CostOptions] = None) -> List[int]:
    """Profiled b with G divisible by d b (and m a multiple of p for interleaved), ascending."""
    d = opts.data_parallel if opts is not None else 1
    sizes = sorted({int(b) for b in profile.micro_batch_sizes if b > 0 and global_batch % (d * b) == 0})
    if opts is not None and opts.schedule == "interleaved":
        sizes = [b for b in sizes if (global_batch // (d * b)) % opts.pipeline_ranks == 0]
    return sizes


def in_flight(stage: int, pipeline_ranks: int, m: int, schedule: str, virtual_stages: int = 1) -> int:
    """h_c: micro-batches whose activations stage c holds at once (module docstring)."""
    p, v = pipeline_ranks, virtual_stages
    if schedule in ("gpipe", "bfs"):
        return m
    if schedule == "1f1b":
        return min(one_f_one_b_warmups([1] * p, m)[stage] + 1, m)
    rank, local = stage % p, stage // p
    warmup = interleaved_warmup(rank, p, v, m)
    return sum(1 for k in range(min(warmup + 1, m * v)) if (k // p) % v == local)


def held_counts(opts: CostOptions, m: int) -> List[int]:
    return [in_flight(c, opts.pipeline_ranks, m, opts.schedule, opts.virtual_stages) for c in range(opts.num_stages)]


def rank_speeds(opts: CostOptions) -> List[float]:
    return [1.0 if opts.cluster is None else opts.cluster.speed(i) for i in range(opts.pipeline_ranks)]


def rank_caps(opts: CostOptions) -> List[Optional[float]]:
    return [opts.memory_cap if opts.cluster is None else opts.cluster.memory(i, opts.memory_cap)
            for i in range(opts.pipeline_ranks)]


def boundary_links(opts: CostOptions) -> List[Tuple[float, float]]:
    """(bandwidth, latency) of boundary j (between stage j and j + 1), j = 0 .. C - 2."""
    p = opts.pipeline_ranks
    links = []
    for j in range(opts.num_stages - 1):
        if opts.cluster is None:
            links.append((opts.bandwidth, opts.latency))
        else:
            links.append(opts.cluster.path(j % p, (j + 1) % p, opts.bandwidth, opts.latency))
    return links


def cut_time(profile: Profile, k: int, b: int, opts: CostOptions, link: Optional[Tuple[float, float]] = None) -> float:
    """t_k = (act + grad) / bandwidth + latency * [act > 0] * (1 + [grad > 0]), in seconds."""
    bandwidth, latency = link if link is not None else (opts.bandwidth, opts.latency)
    cut = profile.cut(k)
    act = cut.activation_bytes(b)
    grad = cut.gradient_bytes(b)
    messages = (1 + (1 if grad > 0 else 0)) if act > 0 else 0
    return (act + grad) / bandwidth + latency * messages


def cut_times(profile: Profile, b: int, opts: CostOptions, link: Optional[Tuple[float, float]] = None) -> List[float]:
    """[t_0, t_1, ..., t_{L-1}] with t_0 = 0 as padding so that t[k] is cut k."""
    return [0.0] + [cut_time(profile, k, b, opts, link) for k in range(1, profile.num_units)]


def stage_call_s(profile: Profile, b: int) -> float:
    """k^f + k^b: seconds (at speed 1) every stage pays per micro-batch on top of its units."""
    forward, backward = profile.stage_overhead(b)
    return forward + backward


def profiled_optimizer_step_s(profile: Profile, optimizer: str) -> float:
    """sum_l o_l: seconds of one `optimizer` step over every unit's parameters, as `planner profile`
    measured them (0 for units without a measurement: analytic and imported profiles)."""
    name = "adamw" if optimizer in ("adam", "adamw") else optimizer
    return sum(float(u.optimizer_s.get(name, 0.0)) for u in profile.units)


def input_bytes(profile: Profile, b: int) -> List[int]:
    """in_l: bytes crossing cut l (what a recomputed unit keeps); in_0 = 0."""
    return [0] + [profile.cut(k).activation_bytes(b) for k in range(1, profile.num_units)]


def allreduce_time(param_bytes: float, opts: CostOptions, holders: Optional[int] = None) -> float:
    """Ring all-reduce of a rank's gradients over n holders (default the d replicas): 2 (n - 1)/n * P / dp_bandwidth."""
    d = opts.data_parallel if holders is None else holders
    bandwidth = opts.dp_bandwidth if opts.dp_bandwidth is not None else opts.bandwidth
    return 2.0 * (d - 1) / d * param_bytes / bandwidth


def shared_parameters(profile: Profile) -> List[Tuple[str, List[int], int]]:
    """(name, sorted unit indices, bytes) of each tied parameter in profile.extra; ValueError if malformed."""
    index = {u.name: i for i, u in enumerate(profile.units)}
    out = []
    for entry in profile.extra.get("shared_parameters", []) or []:
        try:
            name, units, size = str(entry["name"]), list(entry["units"]), int(entry["bytes"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"malformed shared_parameters entry {entry!r}: needs name, units, bytes") from None
        missing = [u for u in units if u not in index]
        if missing:
            raise ValueError(f"shared parameter {name!r} names unknown units {missing}")
        out.append((name, sorted({index[u] for u in units}), size))
    return out


def tie_time(bytes_: int, holders: int, opts: CostOptions) -> float:
    """Per holding stage: 2 (n - 1) bytes / bandwidth (n = stages holding a use; 0 when n = 1)."""
    return 2.0 * (holders - 1) * bytes_ / opts.bandwidth


def validate_boundaries(profile: Profile, boundaries: Sequence[int], b: int, opts: CostOptions) -> None:
    """Raise ValueError unless the plan (boundaries, b) is well formed for this profile."""
    opts.validate()
    L, C = profile.num_units, opts.num_stages
    if C > L:
        raise ValueError(f"{C} stages requested but the profile has only {L} units")
    if len(boundaries) != C - 1:
        raise ValueError(f"{C} stages need {C - 1} boundaries, got {len(boundaries)}: {list(boundaries)}")
    previous = 0
    for k in boundaries:
        if not isinstance(k, int) or not 1 <= k <= L - 1:
            raise ValueError(f"boundary {k!r} is not a cut index in 1..{L - 1}")
        if k <= previous:
            raise ValueError(f"boundaries must be strictly increasing: {list(boundaries)}")
        previous = k
    if b not in profile.micro_batch_sizes:
        raise ValueError(f"micro-batch size {b} was not profiled (profiled: {sorted(profile.micro_batch_sizes)})")
    if opts.global_batch % (opts.data_parallel * b) != 0:
        raise ValueError(f"micro-batch size {b} x data-parallel {opts.data_parallel} does not divide "
                         f"the global batch {opts.global_batch}")
    if opts.replicated and num_micro_batches(opts, b) < max(opts.replicas):
        raise ValueError(f"{num_micro_batches(opts, b)} micro-batches cannot feed a stage with "
                         f"{max(opts.replicas)} replicas; use a smaller micro-batch size or fewer replicas")
    if opts.replicated and shared_parameters(profile):
        raise ValueError("replicated stages do not model tied (shared) parameters; solve without replication")
    if opts.schedule == "interleaved" and num_micro_batches(opts, b) % opts.pipeline_ranks != 0:
        raise ValueError(f"interleaved needs the micro-batch count ({num_micro_batches(opts, b)}) "
                         f"to be a multiple of the pipeline depth {opts.pipeline_ranks}")


def evaluate(profile: Profile, boundaries: Sequence[int], b: int, opts: CostOptions,
             recompute: Iterable[int] = ()) -> PlanCost:
    """Cost of cutting the profile at `boundaries` (C - 1 cuts) with micro-batch size b and the
    units in `recompute` recomputed in backward."""
    validate_boundaries(profile, boundaries, b, opts)
    L, C, p, v = profile.num_units, opts.num_stages, opts.pipeline_ranks, opts.virtual_stages
    redo: FrozenSet[int] = frozenset(recompute)
    if any(not 0 <= l < L for l in redo):
        raise ValueError(f"recomputed unit index out of range 0..{L - 1}: {sorted(redo)}")
    m = num_micro_batches(opts, b)
    opt = optimizer_factor(opts.optimizer)
    edges = [0] + list(boundaries) + [L]
    links = boundary_links(opts)
    speeds, caps, held = rank_speeds(opts), rank_caps(opts), held_counts(opts, m)
    reps = list(opts.replicas) if opts.replicated else [1] * C
    if opts.replicated:  # stage g on devices offset_g .. offset_g + r_g - 1, each holding h_g
        held = [replica_in_flight(g, reps, m, opts.schedule) for g in range(C)]
        offsets = [sum(reps[:g]) for g in range(C)]
    inputs = input_bytes(profile, b)
    stage_of = [c for c in range(C) for _ in range(edges[c], edges[c + 1])]
    ties: Dict[int, float] = {}
    for _, units, size in shared_parameters(profile):
        holders = sorted({stage_of[l] for l in units})
        for c in holders:
            ties[c] = ties.get(c, 0.0) + tie_time(size, len(holders), opts)
    call_forward, call_backward = profile.stage_overhead(b)
    stages: List[StageCost] = []
    for c in range(C):
        first, end, rank = edges[c], edges[c + 1], c % p
        device = offsets[c] if opts.replicated else rank
        units = profile.units[first:end]
        forward = (call_forward + sum(u.forward_s[b] for u in units)) / speeds[rank]
        backward = (call_backward + sum(u.backward_s[b] + (u.forward_s[b] if first + i in redo else 0.0)
                                        for i, u in enumerate(units))) / speeds[rank]
        comm = (cut_time(profile, first, b, opts, links[c - 1]) if c > 0 else 0.0) + \
               (cut_time(profile, end, b, opts, links[c]) if c < C - 1 else 0.0)
        params = sum(u.param_bytes for u in units)
        saved = sum(inputs[first + i] if first + i in redo else u.saved_bytes[b] for i, u in enumerate(units))
        stages.append(StageCost(
            first_unit=first, end_unit=end, device=device, forward_s=forward, backward_s=backward, comm_s=comm,
            time_s=forward + backward + comm, in_flight=held[c], param_bytes=params, grad_bytes=params,
            optimizer_bytes=params * opt, activation_bytes=held[c] * saved,
            memory_bytes=params * (2 + opt) + held[c] * saved,
            extra_s=allreduce_time(params, opts, reps[c] * opts.data_parallel) + ties.get(c, 0.0),
            recompute=sorted(l for l in redo if first <= l < end), replicas=reps[c]))
    if opts.replicated:
        return replicated_plan_cost(stages, b, m, opts, caps[0])
    work = [sum(st.time_s for st in stages if st.device == i) for i in range(p)]
    extra = [sum(st.extra_s for st in stages if st.device == i) for i in range(p)]
    memory = [sum(st.memory_bytes for st in stages if st.device == i) for i in range(p)]
    total = sum(st.time_s for st in stages)
    bottleneck = max(work)
    pipeline = total / v + (m - 1.0 / v) * bottleneck
    iteration = pipeline + max(extra) + opts.per_step_s
    bubble = 1.0 - m * total / (p * pipeline) if pipeline > 0 else 0.0
    feasible = all(cap is None or mem <= cap for mem, cap in zip(memory, caps))
    return PlanCost(micro_batch_size=b, num_micro_batches=m, stages=stages, iteration_s=iteration,
                    bottleneck_s=bottleneck, bubble_fraction=max(0.0, bubble), feasible=feasible,
                    device_memory=memory, device_caps=caps, extra_s=max(extra), schedule=opts.schedule,
                    pipeline_ranks=p, virtual_stages=v, data_parallel=opts.data_parallel)
