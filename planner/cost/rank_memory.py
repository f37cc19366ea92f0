"""A rank's memory in the cost model: what each device holds for the whole step and at its list's peak,
and what it may hold (the caps less the fixed bytes). planner.cost.stage_memory writes the same terms
per stage for the solvers; planner.cost.memory gives the bytes per parameter.

Memory of rank i (bytes): static + the peak, along its list, of what it holds for its stages:

    M_i = sum_{g on i} (P_g beta^w_g + T_g beta^t_g) + F + max over the list's moments of
          sum_{g on i} [ live_g A_g + inbox_g in_{a_g} + gradbox_g grad_{e_g}
                         + sent_act_g in_{e_g} + sent_grad_g grad_{a_g} ]
    A_g = sum_{l in g} (in_l if l in R else s_l)

and, under zero-bubble schedules, + weight_g H_g with H_g = sum_{l in g} (in_l if l in R else h_l): the
bytes held from a micro-batch's input backward to its weight backward.
live_g: micro-batches of stage g forwarded and not yet (input-)backwarded; weight_g: those between the two
parts; inbox_g / gradbox_g: activations (gradients) received and not yet used; sent_act_g /
sent_grad_g: outputs (input gradients) posted in a batch of sends only and not yet waited for
(planner.pipeline.stepgraph.held_peaks); in_l: bytes crossing
cut l (in_0 = 0). P_g, T_g: stage g's parameter bytes and, of them, the trainable ones (the rest
are frozen: requires_grad=False). beta^w_g, beta^t_g (`static_factors`): bytes held per parameter
byte of the profile — the weights for every parameter; gradients, master weights and optimizer
state for a trainable one — in the precision's dtypes, sharded over the stage's n_g = r_g d holders
(planner.cost.memory). F (`fixed_bytes`): the per-device reserve plus, under `parameters`
sharding, two gathered units and one unit's whole gradients. A plan is feasible iff M_i <= cap_i.

Tied weights: a rank holds one copy of each (planner.cost.ties: the static bytes its units count
beyond it are taken off, `static_surplus`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from planner.cost import memory as memory_model
from planner.cost.options import CostOptions
from planner.cost.split import Split
from planner.cost.step import StepShape, rank_peaks, stage_devices
from planner.cost.ties import TieCopy, copy_static, static_surplus
from planner.profile.profile import Profile


def precision_of(opts: CostOptions, dtype: str, measured: Optional[str] = None) -> str:
    """The precision a plan of a profile of this dtype runs at: the options', else the one the
    profile was measured at (`measured`: Profile.precision), else the dtype's default."""
    return opts.precision or measured or memory_model.default_precision(dtype)


def static_factors(opts: CostOptions, dtype: str, holders: Optional[int] = None) -> Tuple[float, float]:
    """(bytes a device keeps per parameter byte, more per trainable parameter byte) of a `dtype`
    profile for a stage of n holders (default the d replicas): every parameter's weights, and a
    trainable one's gradient, master weight and optimizer state (planner.cost.memory)."""
    n = opts.data_parallel if holders is None else holders
    held = memory_model.bytes_per_param(precision_of(opts, dtype), opts.optimizer, _shard(opts), n)
    itemsize = memory_model.param_itemsize(dtype)
    return held.weights / itemsize, held.training / itemsize


def static_bytes(params, trainable, opts: CostOptions, dtype: str, holders: Optional[int] = None):
    """Bytes a device keeps for the whole step for parameters of `params` profile bytes of which
    `trainable` train (numbers or numpy arrays of them): beta_w P + beta_t T."""
    weights, training = static_factors(opts, dtype, holders)
    return params * weights + trainable * training


def reserve_of(profile: Profile, opts: CostOptions) -> float:
    """Bytes kept free on every device: the options', else the profile's device default."""
    if opts.reserve_bytes is not None:
        return float(opts.reserve_bytes)
    spec = (profile.extra.get("analytic") or {}).get("device_spec")
    return memory_model.default_reserve(profile.device, spec if isinstance(spec, dict) else None)


def fixed_bytes(profile: Profile, opts: CostOptions) -> float:
    """F: bytes every device holds whatever its stages: the reserve, and under `parameters`
    sharding with several holders the two largest gathered units (the running one and the
    prefetched one; the profile's largest unit, twice, whatever the split: a bound) and the whole
    gradients of the largest trainable one (the running unit's, until reduce-scattered)."""
    gathered = 0.0
    if _shard(opts) == "parameters" and (opts.data_parallel > 1 or opts.replicated):
        largest = max((u.param_bytes for u in profile.units), default=0)
        largest_trainable = max((u.trainable_bytes for u in profile.units), default=0)
        weights, grads = memory_model.gathered_bytes_per_param(precision_of(opts, profile.dtype, profile.precision),
                                                                 "parameters")
        gathered = (2 * largest * weights + largest_trainable * grads) / memory_model.param_itemsize(profile.dtype)
    return reserve_of(profile, opts) + gathered


def _shard(opts: CostOptions) -> str:
    if opts.shard == "auto":
        raise ValueError("shard 'auto' is the solver's choice: cost a plan with a concrete shard "
                         f"({', '.join(memory_model.SHARDS)})")
    return opts.shard


def rank_caps(opts: CostOptions, profile: Profile) -> List[Optional[float]]:
    """What each rank's stages may hold: its cap less the fixed bytes F (`fixed_bytes`); None: no cap."""
    fixed = fixed_bytes(profile, opts)
    return [None if cap is None else cap - fixed for cap in _device_caps(opts, opts.pipeline_ranks)]


def _device_caps(opts: CostOptions, devices: int) -> List[Optional[float]]:
    view = opts.device_view
    return [opts.memory_cap if view is None else view.memory(i, opts.memory_cap) for i in range(devices)]


def held_bytes(split: Split, opts: CostOptions) -> Dict[Tuple, float]:
    """Bytes per held item of each kind (planner.pipeline.stepgraph.held_peaks' terms)."""
    costs, S = split.costs, opts.num_stages
    out: Dict[Tuple, float] = {}
    for g in range(S):
        a, e = split.units(g)
        out[("live", g)] = costs.saved(a, e, split.redo)
        out[("inbox", g)] = float(costs.act[a]) if g > 0 else 0.0
        out[("gradbox", g)] = float(costs.grad[e]) if g < S - 1 else 0.0
        out[("sent_act", g)] = float(costs.act[e]) if g < S - 1 else 0.0
        out[("sent_grad", g)] = float(costs.grad[a]) if g > 0 else 0.0
        # between its input and weight backwards: what the weight gradients read
        out[("weight", g)] = costs.weight_held(a, e, split.redo)
    return out


def device_memory(split: Split, opts: CostOptions, shape: StepShape, ties: Sequence[TieCopy] = ()) -> List[float]:
    """M_i per device: static bytes of its stages, less the extra copies of tied weights (frozen or
    not: planner.cost.ties.tied_weights) it holds once, + the peak of what its list holds (module docstring)."""
    held = held_bytes(split, opts)
    out = []
    devices = stage_devices(shape)
    statics = [_stage_static(split, opts, shape, g) for g in range(opts.num_stages)]
    extra = static_surplus(ties, copy_static(ties, static_factors(opts, split.dtype)),
                           [shape.rank_of(g) for g in split.stage_of], shape.pipeline_ranks,
                           copy_static(ties, static_factors(opts, split.dtype, 1)), _shard(opts))
    for i, peaks in enumerate(rank_peaks(shape)):
        static = sum(statics[g] for g in range(opts.num_stages) if i in devices[g])
        static -= extra[i]
        activations = max((sum(n * held[term] for term, n in peak.items()) for peak in peaks), default=0.0)
        out.append(static + split.fixed + activations)
    return out


def _stage_static(split: Split, opts: CostOptions, shape: StepShape, g: int) -> float:
    """Static bytes of stage g's parameters, sharded over its r_g d holders."""
    a, e = split.units(g)
    return static_bytes(split.costs.params(a, e), split.costs.trainable(a, e), opts, split.dtype,
                        len(stage_devices(shape)[g]) * opts.data_parallel)
