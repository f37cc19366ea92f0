"""The cost model: what a plan costs, in time and memory — those of the lists the runtime executes.

Notation. The profile has L ordered units. A plan has p pipeline ranks per data-parallel replica, d
replicas, v stages per rank (v = 1 except for `interleaved`/`bfs`) and S = p v stages, stage g holding
units [a_g, e_g) and running on rank g mod p (looping placement; zb-v: the V, rank g for g < p, 2p - 1 - g after). The S - 1 boundaries are the cuts
e_0 < ... < e_{S-2}. A global batch of G samples is G = d m b: each replica runs m micro-batches of
size b. R is the set of recomputed units. Replicated stages (PipeDream-style, v = 1): stage g runs
on r_g devices, micro-batch i on its replica i mod r_g (planner.pipeline.topology).

Time. The plan's step is the event simulation of its lists (planner.pipeline.stepgraph: the
runtime's semantics; planner.pipeline.messages: where messages go) with these durations, stage g
on rank i at speed sigma_i (planner.cost.ranges):

    forward g      (k^f + sum_{l in g} f_l) / sigma_i
    backward g     (k^b + sum_{l in g} g_l + sum_{l in g, l in R} f_l) / sigma_i
    act g, grad g  latency + bytes / bandwidth of the activations (gradients) across boundary g
                   (the link between the two stages' ranks; 0 for a stage handing over on its rank)
    message        a fixed cost per message on each side (`message_s`)
    tie t          2 (n - 1) / n * bytes_t / bandwidth: all-reduce of tied weight t over the n ranks
                   (all replicas; one under local SGD) holding a use of it, when its uses span several ranks
    lanes g        the same over n = r_g d holders: a replicated stage's exchange
    reduce i       the data-parallel exchange of rank i's trainable T_i over the replicas / dp_bandwidth:
                   an all-reduce, 2 (d - 1) / d T_i, or the sharded exchanges (planner.cost.memory;
                   frozen parameters exchange nothing, except their gathers under `parameters`: for
                   every forward, and for the backwards of units whose backward runs, planner.cost.ranges),
                   plus its rings' latency under a placement when it exchanges any bytes (planner.cost.exchange;
                   under `parameters` one ring's per gather and reduce-scatter the runtime issues);
                   under local SGD (sync_every H > 1) the model averaging's time / H, its trainable
                   parameters and floating-point buffers (planner.cost.localsgd)
    step i         sum_{l on i} o_l / sigma_i: rank i's optimizer step over its units

    (A unit's bytes and step include the tied weights it uses; rank i holds one copy of each: its
    exchange, step and static memory take off the copies its units count beyond it, and the exchange
    that copy too where the tie spans ranks, its all-reduce being the tie term: planner.cost.ties.
    Under ZeRO-3 a copy the rank keeps whole is never gathered: the exchange takes off every copy of
    it, frozen or not, and all-reduces a trainable one on this rank alone once per step, bandwidth
    only. The collective counts are the units' as planner.cost.ranges counts them: a unit whose only
    parameters are kept whole is still charged its gathers' latency under a placement, an
    over-charge where such a unit exists, kept for one rule shared by the model, the solvers and
    the plan's emulated rings.)

    backward_input g, backward_weight g   (zero-bubble schedules) the backward's two parts,
                   (k^b + sum gi_l + sum_{l in R} f_l) / sigma_i and (sum gw_l + sum_{l in R} f_l) / sigma_i
                   (planner.cost.ranges: a recomputed unit recomputes in both)

    iteration = step time of the lists + step_overhead (a constant, e.g. from `planner calibrate`)

(k^f, k^b: the profile's per-stage call cost; a recomputed unit re-runs as its own checkpointed
call, whose fixed cost is not charged.) The step time is the longest path through the lists' graph,
a maximum of sums of these durations; the solvers optimise exactly that (planner.solve.exact).

Memory of rank i: planner.cost.rank_memory (static bytes, the peak of what its list holds, the caps).
Interleaved needs m to be a multiple of p (Megatron's rule).

Precision. Activations and cut messages are counted in the precision's compute dtype
(planner.cost.compute_dtype: another dtype's profile scaled, one measured at the plan's precision as measured).
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from planner.cost.compute_dtype import compute_profile
from planner.cost.exchange import (collective_latency, exchange_latency, reduce_time, sync_factors,  # noqa: F401
                                   sync_time, tie_time, whole_reduce_time)  # (importable from here too)
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.cost.split import Split  # noqa: F401  (importable from here too)
from planner.cost.result import PathForm, PlanCost, StageCost
from planner.cost.step import StepShape, rank_peaks, run_many, stage_devices, stage_in_flight, step_graph
from planner.cost.ties import (Surplus, TieCopy, shared_parameters, surplus, tie_copies,  # noqa: F401
                               kept_whole, tied_weights, uses_per_device)
from planner.pipeline.schedule import MAX_MICRO_BATCHES, ZERO_BUBBLE_SCHEDULES, stage_placement
from planner.cost import memory as memory_model
from planner.cost.rank_memory import (_device_caps, _shard, device_memory, fixed_bytes, held_bytes,  # noqa: F401
                                      precision_of, rank_caps, reserve_of, static_bytes, static_factors)
from planner.profile.profile import Profile


def num_micro_batches(opts: CostOptions, b: int) -> int:
    """m = G / (d b)."""
    return opts.global_batch // (opts.data_parallel * b)


def candidate_micro_batch_sizes(profile: Profile, global_batch: int, opts: Optional[CostOptions] = None) -> List[int]:
    """Profiled b with G divisible by d b (and m a multiple of p for interleaved) and at most
    MAX_MICRO_BATCHES micro-batches, ascending."""
    d = opts.data_parallel if opts is not None else 1
    sizes = sorted({int(b) for b in profile.micro_batch_sizes if b > 0 and global_batch % (d * b) == 0
                    and global_batch // (d * b) <= MAX_MICRO_BATCHES})
    if opts is not None and opts.schedule == "interleaved":
        sizes = [b for b in sizes if (global_batch // (d * b)) % opts.pipeline_ranks == 0]
    return sizes


def step_shape(opts: CostOptions, m: int, collectives=()) -> StepShape:
    """The shape of the lists a plan of these options runs with m micro-batches."""
    return StepShape(opts.schedule, opts.num_stages, m, opts.virtual_stages,
                     tuple(opts.replicas) if opts.replicated else (), tuple(collectives))


def held_counts(opts: CostOptions, m: int) -> List[int]:
    """h_g per stage: the most micro-batches stage g holds for backward at once, from its lists."""
    return stage_in_flight(step_shape(opts, m))


def rank_speeds(opts: CostOptions, devices: Optional[int] = None) -> List[float]:
    """sigma_i of each of the first `devices` devices (default the pipeline ranks)."""
    count = opts.pipeline_ranks if devices is None else devices
    view = opts.device_view
    return [1.0 if view is None else view.speed(i) for i in range(count)]


def boundary_links(opts: CostOptions) -> List[Tuple[float, float]]:
    """(bandwidth, latency) of boundary j (between stage j and j + 1), j = 0 .. S - 2."""
    links, view = [], opts.device_view
    for j in range(opts.num_stages - 1):
        if view is None:
            links.append((opts.bandwidth, opts.latency))
        else:
            links.append(view.path(opts.rank_of_stage(j), opts.rank_of_stage(j + 1), opts.bandwidth, opts.latency))
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


def input_bytes(profile: Profile, b: int) -> List[int]:
    """in_l: what a recomputed unit keeps, its inputs (planner.cost.ranges)."""
    return [int(x) for x in range_costs(profile, b).inputs]


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
    """Cost of cutting the profile at `boundaries` (S - 1 cuts) with micro-batch size b and the
    units in `recompute` recomputed in backward: the simulated step of the plan's lists."""
    validate_boundaries(profile, boundaries, b, opts)
    profile = compute_profile(profile, opts)
    L, S = profile.num_units, opts.num_stages
    redo: FrozenSet[int] = frozenset(recompute)
    if any(not 0 <= l < L for l in redo):
        raise ValueError(f"recomputed unit index out of range 0..{L - 1}: {sorted(redo)}")
    # a unit whose backward needs nothing is never recomputed (it would keep its inputs for nothing): not in the
    # plan's lists, which the runtime runs (planner.cost.shared_storage.never_recomputed)
    recomputable = range_costs(profile, b, opts.optimizer).recomputable
    redo = frozenset(l for l in redo if recomputable[l])
    m = num_micro_batches(opts, b)
    split, shape, value, copies = _step_of(profile, boundaries, redo, b, opts)
    timeline = step_graph(shape).run(value)
    memory = device_memory(split, opts, shape, copies)
    devices = shape.pipeline_ranks
    caps = _device_caps(opts, devices)
    busy = [0.0] * devices
    for g in range(S):
        lanes = _devices_of(shape, g)
        for lane in lanes:  # a stage's replica runs every r_g-th micro-batch
            share = len(range(lanes.index(lane), m, len(lanes)))
            busy[lane] += share * (value[("forward", g)] + backward_work(value, opts.schedule, g))
    step = timeline.step_s
    bubble = 1.0 - sum(busy) / (devices * step) if step > 0 else 0.0
    end_work = [value[("reduce", i)] + value[("step", i)] for i in range(devices)]
    return PlanCost(micro_batch_size=b, num_micro_batches=m,
                    stages=_stage_costs(split, opts, shape, value, copies),
                    iteration_s=step + opts.step_overhead_s, bottleneck_s=max(busy) / m,
                    bubble_fraction=max(0.0, bubble),
                    feasible=all(cap is None or mem <= cap for mem, cap in zip(memory, caps)),
                    device_memory=memory, device_caps=caps, extra_s=max(end_work), schedule=opts.schedule,
                    pipeline_ranks=devices, virtual_stages=opts.virtual_stages, data_parallel=opts.data_parallel,
                    critical_path=path_form(timeline), durations=value, collectives=shape.collectives)


def backward_work(value: Dict[Tuple, float], schedule: str, g: int) -> float:
    """Seconds of stage g's backward of one micro-batch in this schedule's lists (split in two parts
    under the zero-bubble schedules)."""
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return value[("backward_input", g)] + value[("backward_weight", g)]
    return value[("backward", g)]


def _step_of(profile: Profile, boundaries: Sequence[int], redo: FrozenSet[int], b: int, opts: CostOptions
             ) -> Tuple["Split", StepShape, Dict[Tuple, float], List[TieCopy]]:
    """(split, the shape of its lists, every duration term, its tied weights' copies, frozen ones too)
    of a valid split of a compute profile."""
    split = Split(range_costs(profile, b, opts.optimizer), tuple([0] + list(boundaries) + [profile.num_units]), redo,
                  profile.dtype, fixed_bytes(profile, opts))
    copies = tie_copies(tied_weights(profile), split.costs)
    shape = step_shape(opts, num_micro_batches(opts, b), step_collectives(copies, split, opts))
    return split, shape, step_durations(split, opts, shape, copies), copies


def simulate_splits(profile: Profile, splits: Sequence[Tuple[Sequence[int], Iterable[int]]], b: int,
                    opts: CostOptions) -> List[Optional[Tuple[float, PathForm]]]:
    """(iteration seconds, longest path) of each split (boundaries, recomputed units), exactly as
    `evaluate` gives them, the step graph run for all of them at once (planner.cost.step.run_many); no
    memory, so a search screens many splits with it and evaluates the ones it keeps. None for a
    split that is not valid."""
    profile = compute_profile(profile, opts)
    groups: Dict[StepShape, List[Tuple[int, Dict[Tuple, float]]]] = {}
    for k, (boundaries, recompute) in enumerate(splits):
        try:
            validate_boundaries(profile, boundaries, b, opts)
        except ValueError:
            continue
        _, shape, value, _ = _step_of(profile, boundaries, frozenset(recompute), b, opts)
        groups.setdefault(shape, []).append((k, value))
    out: List[Optional[Tuple[float, PathForm]]] = [None] * len(splits)
    for shape, members in groups.items():
        for (k, _), timeline in zip(members, run_many(step_graph(shape), [value for _, value in members])):
            out[k] = (timeline.step_s + opts.step_overhead_s, path_form(timeline))
    return out


def path_form(timeline) -> PathForm:
    """The longest path of a simulated step as a PathForm (tied-weight crossings named by weight)."""
    return PathForm(counts=tuple(sorted(timeline.critical.items(), key=repr)),
                    crossings=tuple((term[1], j, i) for term, j, i in timeline.crossings if term[0] == "tie"))


def _devices_of(shape: StepShape, g: int) -> Tuple[int, ...]:
    """The devices running stage g (one, or a replicated stage's r_g)."""
    return stage_devices(shape)[g]


def step_collectives(ties: Sequence[TieCopy], split: "Split", opts: CostOptions) -> List[Tuple[Tuple, Tuple[int, ...]]]:
    """The step's collectives in run order: the trainable tied weights whose uses span ranks (by
    name), then each replicated stage's all-reduce over its replicas."""
    trained = sorted((t for t in ties if t.trainable), key=lambda t: t.name)
    placement = stage_placement(opts.schedule, opts.num_stages, opts.virtual_stages) if trained else ()
    ranks = [placement[g] for g in split.stage_of] if trained else []  # per unit: only where a tie needs it
    out = []
    for tie in trained:
        holders = tuple(sorted(uses_per_device(tie, ranks)))
        if len(holders) > 1:
            out.append((("tie", tie.name), holders))
    for g, r in enumerate(opts.replicas if opts.replicated else ()):
        if r > 1:
            first = sum(opts.replicas[:g])
            out.append((("lanes", g), tuple(range(first, first + r))))
    return out


def step_durations(split: Split, opts: CostOptions, shape: StepShape, ties: Sequence[TieCopy] = ()) -> Dict[Tuple, float]:
    """Every duration term of the step graph for this split (module docstring)."""
    costs, S, devices = split.costs, opts.num_stages, shape.pipeline_ranks
    speeds, links = rank_speeds(opts, devices), boundary_links(opts)
    value: Dict[Tuple, float] = {("message",): opts.message_s}
    for g in range(S):
        (a, e), speed = split.units(g), speeds[shape.rank_of(g)]
        value[("forward", g)] = costs.forward(a, e, speed)
        value[("backward", g)] = costs.backward(a, e, speed, split.redo)
        value[("backward_input", g)] = costs.backward_input(a, e, speed, split.redo)
        value[("backward_weight", g)] = costs.backward_weight(a, e, speed, split.redo)
        if g < S - 1:
            value[("act", g)] = costs.message_s(e, links[g])
            value[("grad", g)] = costs.message_s(e, links[g], gradient=True)
    params, trainable, steps = [0.0] * devices, [0.0] * devices, [0.0] * devices
    frozen_backward, collectives, buffers = [0.0] * devices, [0.0] * devices, [0.0] * devices
    lanes = [0] * devices  # devices of the stage a device runs (replicated stages: r_g)
    for g in range(S):
        for i in _devices_of(shape, g):
            params[i] += costs.params(*split.units(g))
            trainable[i] += costs.trainable(*split.units(g))
            frozen_backward[i] += costs.frozen_backward(*split.units(g))
            collectives[i] += costs.sharded_collectives(*split.units(g))
            buffers[i] += costs.buffers(*split.units(g))
            steps[i] += costs.step(*split.units(g), speed=speeds[i])
            lanes[i] = len(_devices_of(shape, g))
    m, extra = shape.num_micro_batches, tie_surplus(split, shape, ties, opts.local_sgd, opts.shard)
    for i in range(devices):  # a tied weight's extra uses on a rank are one copy (planner.cost.ties)
        params[i] -= extra.exchanged[i] + extra.ungathered[i]
        trainable[i] -= extra.exchanged[i]
        frozen_backward[i] -= extra.ungathered_backward[i]
        value[("reduce", i)] = (reduce_time(params[i], trainable[i], frozen_backward[i], opts, split.dtype, m, i,
                                            collectives[i], buffers[i], extra.whole_reduced[i])
                                if lanes[i] == 1 else 0.0)
        value[("step", i)] = steps[i] - extra.step_s[i] / speeds[i]
    sizes = {tie.name: tie.size for tie in ties}
    for term, members in shape.collectives:
        if term[0] == "tie":
            value[term] = tie_time(sizes[term[1]], len(members) * opts.tie_replicas, opts)
        else:
            g = term[1]
            holders = len(members) * opts.data_parallel
            value[term] = sync_time(costs.params(*split.units(g)), costs.trainable(*split.units(g)),
                                    costs.frozen_backward(*split.units(g)), opts, split.dtype, m, holders)
    return value


def tie_surplus(split: Split, shape: StepShape, ties: Sequence[TieCopy], averaged: bool = False,
                shard: str = "none") -> Surplus:
    """What the per-unit sums of each device count beyond the one copy of each tied weight it holds,
    and what ZeRO-3 keeps whole (planner.cost.ties; tied weights come without replicated stages: one
    device per stage); averaged: under local SGD."""
    if not ties:  # every split a search screens: nothing to take off
        return Surplus.zero(shape.pipeline_ranks)
    return surplus(ties, [shape.rank_of(g) for g in split.stage_of], shape.pipeline_ranks, averaged, shard)


def _stage_costs(split: Split, opts: CostOptions, shape: StepShape, value: Dict[Tuple, float],
                 ties: Sequence[TieCopy] = ()) -> List[StageCost]:
    """Per-stage figures for tables and the plan file (on the stage's first device); a tied weight
    used more than once in a stage counted once in its parameters, whole where its rank keeps it
    whole under ZeRO (planner.cost.ties.kept_whole, as device_memory counts it)."""
    costs, S = split.costs, opts.num_stages
    extra = surplus(ties, split.stage_of, S)
    whole, whole_trained = _whole_tie_bytes(split, shape, ties, _shard(opts), S)
    held, in_flight = held_bytes(split, opts), stage_in_flight(shape)
    precision, itemsize = precision_of(opts, split.dtype), memory_model.param_itemsize(split.dtype)
    stages = []
    for g in range(S):
        (a, e), device = split.units(g), shape.rank_of(g)
        comm = (value[("act", g - 1)] + value[("grad", g - 1)] if g > 0 else 0.0) + \
               (value[("act", g)] + value[("grad", g)] if g < S - 1 else 0.0)
        count = (costs.params(a, e) - extra.held[g]) / itemsize
        trained = (costs.trainable(a, e) - extra.held_trained[g]) / itemsize  # frozen parameters: weights only
        holders = len(_devices_of(shape, g)) * opts.data_parallel
        per = memory_model.bytes_per_param(precision, opts.optimizer, opts.shard, holders)
        # the copies its rank keeps whole under ZeRO: unsharded bytes per parameter (as device_memory)
        one = memory_model.bytes_per_param(precision, opts.optimizer, opts.shard, 1)
        weights = (count - whole[g]) * per.weights + whole[g] * one.weights
        grads = (trained - whole_trained[g]) * per.grads + whole_trained[g] * one.grads
        state = (trained - whole_trained[g]) * (per.master + per.optimizer) + \
            whole_trained[g] * (one.master + one.optimizer)
        # the most its own micro-batches hold at once along its rank's list (zero-bubble: with the
        # bytes kept for the weight part)
        activations = max((p.get(("live", g), 0) * held[("live", g)] + p.get(("weight", g), 0) * held[("weight", g)]
                           for p in rank_peaks(shape)[device]), default=0.0)
        collective = sum(value[term] for term, members in shape.collectives if device in members)
        backward = backward_work(value, opts.schedule, g)
        parts = opts.schedule in ZERO_BUBBLE_SCHEDULES
        stages.append(StageCost(
            first_unit=a, end_unit=e, device=device, forward_s=value[("forward", g)],
            backward_s=backward, comm_s=comm, time_s=value[("forward", g)] + backward + comm, in_flight=in_flight[g],
            backward_input_s=value[("backward_input", g)] if parts else None,
            backward_weight_s=value[("backward_weight", g)] if parts else None,
            saved_per_micro_batch=held[("live", g)], weight_held_per_micro_batch=held[("weight", g)] if parts else None,
            param_bytes=int(weights), grad_bytes=int(grads), optimizer_bytes=state,
            activation_bytes=int(activations), memory_bytes=weights + grads + state + activations,
            extra_s=value[("reduce", device)] + collective,
            recompute=sorted(l for l in split.redo if a <= l < e), replicas=len(_devices_of(shape, g))))
    return stages


def _whole_tie_bytes(split: Split, shape: StepShape, ties: Sequence[TieCopy], shard: str,
                     S: int) -> Tuple[List[float], List[float]]:
    """Per stage, the parameter elements (of them trainable) of the tie copies it counts that its rank
    keeps whole under ZeRO (planner.cost.ties.kept_whole, decided per rank as device_memory does)."""
    params, trained = [0.0] * S, [0.0] * S
    itemsize, unit_rank = memory_model.param_itemsize(split.dtype), [shape.rank_of(g) for g in split.stage_of]
    for tie in ties:
        ranks = uses_per_device(tie, unit_rank)
        for g in uses_per_device(tie, split.stage_of):
            if kept_whole(shard, tie.trainable, len(ranks) > 1, ranks[shape.rank_of(g)]):
                params[g] += tie.bytes_ / itemsize
                trained[g] += tie.trained_bytes / itemsize
    return params, trained
