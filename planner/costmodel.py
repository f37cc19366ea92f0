"""The pipeline cost model: what a split of the units into stages costs, in time and memory.

Notation. The profile has L ordered units; a plan has S stages, stage s holding the contiguous
unit range [a_s, e_s) with a_0 = 0, e_{S-1} = L and e_s = a_{s+1}. The S - 1 *boundaries* are
the cuts e_0 < e_1 < ... < e_{S-2}, each in 1..L-1. A global batch of G samples is split into
m = G / b micro-batches of size b (b must be a profiled size dividing G).

Time (per micro-batch, seconds):

    F_s = sum_{l in [a_s, e_s)} forward_s_l[b]          B_s = sum backward_s_l[b]
    c_k = (act_k(b) + grad_k(b)) / bandwidth + latency * [act_k(b) > 0] * (1 + [grad_k(b) > 0])
    T_s = F_s + B_s + c_{a_s} [s > 0] + c_{e_s} [s < S - 1]

A cut's transfer is charged to both the sending and the receiving stage (neither can overlap it
with compute in this model). For both GPipe and 1F1B the iteration time is the classic
fill-drain bound

    iteration = sum_s T_s + (m - 1) * max_s T_s

(every micro-batch passes every stage once; the bottleneck stage paces the steady state).

Memory (bytes per device):

    M_s = P_s * (2 + opt) + inflight_s * A_s(b)

with P_s = sum of param_bytes (parameters + gradients + opt bytes of optimizer state per
parameter byte), A_s(b) = sum saved_bytes[b] (activations kept for backward, per micro-batch),
and inflight_s = min(S - s, m) for 1F1B (stage s holds at most S - s micro-batches between
their forward and backward), m for GPipe (all forwards run before any backward).
A plan is feasible iff M_s <= memory_cap for every s (no cap: always feasible).

This module is the single source of truth: the integer program, the brute-force oracle and the
plan file all use these formulas.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from planner.profile import OPTIMIZER_STATE_PER_PARAM_BYTE, Profile

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class CostOptions:
    """What the planner is asked: S stages, a global batch of G samples, and the hardware."""

    num_stages: int
    global_batch: int
    schedule: str = "1f1b"  # or "gpipe"
    bandwidth: float = 5e9  # bytes/s between consecutive stages
    latency: float = 0.0  # seconds per message (one per direction per cut with tensors)
    memory_cap: Optional[float] = None  # bytes per device; None = unlimited
    optimizer: str = "sgd"

    def validate(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"the number of stages must be at least 1 (got {self.num_stages})")
        if self.global_batch < 1:
            raise ValueError(f"the global batch must be at least 1 (got {self.global_batch})")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be positive bytes/s (got {self.bandwidth})")
        if self.latency < 0:
            raise ValueError(f"latency must be >= 0 seconds (got {self.latency})")
        if self.memory_cap is not None and not self.memory_cap > 0:
            raise ValueError(f"memory per device must be positive bytes (got {self.memory_cap})")
        if self.optimizer not in OPTIMIZER_STATE_PER_PARAM_BYTE:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of "
                             f"{', '.join(sorted(OPTIMIZER_STATE_PER_PARAM_BYTE))}")


@dataclass
class StageCost:
    """One stage of an evaluated plan; times in seconds per micro-batch, memory in bytes."""

    first_unit: int
    end_unit: int  # exclusive
    forward_s: float
    backward_s: float
    comm_s: float  # transfer time charged to this stage (receive + send, both directions)
    time_s: float  # T_s = forward + backward + comm
    in_flight: int  # micro-batches whose activations are held at once
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: float
    activation_bytes: int  # in_flight * saved bytes per micro-batch
    memory_bytes: float  # params + grads + optimizer + activations


@dataclass
class PlanCost:
    micro_batch_size: int
    num_micro_batches: int
    stages: List[StageCost]
    iteration_s: float  # sum_s T_s + (m - 1) max_s T_s
    bottleneck_s: float  # max_s T_s
    bubble_fraction: float  # 1 - sum_s m T_s / (S * iteration): share of device time idle
    feasible: bool  # every stage's memory fits the cap


def candidate_micro_batch_sizes(profile: Profile, global_batch: int) -> List[int]:
    """The profiled micro-batch sizes b that divide the global batch, ascending."""
    return sorted({int(b) for b in profile.micro_batch_sizes if b > 0 and global_batch % b == 0})


def optimizer_factor(optimizer: str) -> float:
    """opt: optimizer-state bytes per parameter byte."""
    return float(OPTIMIZER_STATE_PER_PARAM_BYTE[optimizer])


def in_flight(stage: int, num_stages: int, num_micro_batches: int, schedule: str) -> int:
    """inflight_s = min(S - s, m) for 1F1B, m for GPipe."""
    if schedule == "gpipe":
        return num_micro_batches
    return min(num_stages - stage, num_micro_batches)


def cut_time(profile: Profile, k: int, b: int, opts: CostOptions) -> float:
    """c_k = (act + grad) / bandwidth + latency * [act > 0] * (1 + [grad > 0]), in seconds."""
    cut = profile.cut(k)
    act = cut.activation_bytes(b)
    grad = cut.gradient_bytes(b)
    messages = (1 + (1 if grad > 0 else 0)) if act > 0 else 0
    return (act + grad) / opts.bandwidth + opts.latency * messages


def cut_times(profile: Profile, b: int, opts: CostOptions) -> List[float]:
    """[c_0, c_1, ..., c_{L-1}] with c_0 = 0 as padding so that c[k] is cut k."""
    return [0.0] + [cut_time(profile, k, b, opts) for k in range(1, profile.num_units)]


def stage_memory(profile: Profile, first: int, end: int, stage: int, b: int, opts: CostOptions) -> float:
    """M_s = P_s * (2 + opt) + inflight_s * A_s(b) for units [first, end) placed as stage `stage`."""
    units = profile.units[first:end]
    params = sum(u.param_bytes for u in units)
    saved = sum(u.saved_bytes[b] for u in units)
    m = opts.global_batch // b
    return params * (2 + optimizer_factor(opts.optimizer)) + in_flight(stage, opts.num_stages, m, opts.schedule) * saved


def validate_boundaries(profile: Profile, boundaries: Sequence[int], b: int, opts: CostOptions) -> None:
    """Raise ValueError unless the plan (boundaries, b) is well formed for this profile."""
    opts.validate()
    L, S = profile.num_units, opts.num_stages
    if S > L:
        raise ValueError(f"{S} stages requested but the profile has only {L} units")
    if len(boundaries) != S - 1:
        raise ValueError(f"{S} stages need {S - 1} boundaries, got {len(boundaries)}: {list(boundaries)}")
    previous = 0
    for k in boundaries:
        if not isinstance(k, int) or not 1 <= k <= L - 1:
            raise ValueError(f"boundary {k!r} is not a cut index in 1..{L - 1}")
        if k <= previous:
            raise ValueError(f"boundaries must be strictly increasing: {list(boundaries)}")
        previous = k
    if b not in profile.micro_batch_sizes:
        raise ValueError(f"micro-batch size {b} was not profiled (profiled: {sorted(profile.micro_batch_sizes)})")
    if opts.global_batch % b != 0:
        raise ValueError(f"micro-batch size {b} does not divide the global batch {opts.global_batch}")


def evaluate(profile: Profile, boundaries: Sequence[int], b: int, opts: CostOptions) -> PlanCost:
    """Cost of cutting the profile at `boundaries` (S - 1 cut indices) with micro-batch size b."""
    validate_boundaries(profile, boundaries, b, opts)
    L, S = profile.num_units, opts.num_stages
    m = opts.global_batch // b
    opt = optimizer_factor(opts.optimizer)
    edges = [0] + list(boundaries) + [L]
    c = cut_times(profile, b, opts)
    stages: List[StageCost] = []
    for s in range(S):
        first, end = edges[s], edges[s + 1]
        units = profile.units[first:end]
        forward = sum(u.forward_s[b] for u in units)
        backward = sum(u.backward_s[b] for u in units)
        comm = (c[first] if s > 0 else 0.0) + (c[end] if s < S - 1 else 0.0)
        params = sum(u.param_bytes for u in units)
        saved = sum(u.saved_bytes[b] for u in units)
        held = in_flight(s, S, m, opts.schedule)
        memory = stage_memory(profile, first, end, s, b, opts)
        stages.append(StageCost(
            first_unit=first, end_unit=end, forward_s=forward, backward_s=backward, comm_s=comm,
            time_s=forward + backward + comm, in_flight=held, param_bytes=params, grad_bytes=params,
            optimizer_bytes=params * opt, activation_bytes=held * saved, memory_bytes=memory))
    times = [st.time_s for st in stages]
    bottleneck = max(times)
    iteration = sum(times) + (m - 1) * bottleneck
    busy = m * sum(times)
    bubble = 1.0 - busy / (S * iteration) if iteration > 0 else 0.0
    cap = opts.memory_cap
    feasible = cap is None or all(st.memory_bytes <= cap for st in stages)
    return PlanCost(micro_batch_size=b, num_micro_batches=m, stages=stages, iteration_s=iteration,
                    bottleneck_s=bottleneck, bubble_fraction=max(0.0, bubble), feasible=feasible)
