"""Local SGD: data-parallel replicas that train alone and average their models every H steps.

With `sync_every` H = 1 the d replicas all-reduce their gradients every step (one trainer on d
devices). With H > 1 (local SGD, also called periodic model averaging) each replica is a trainer of
its own, stepping its optimizer on its own gradients (its loss scaled by 1/m, not 1/(d m)), and
after every H-th step the replicas average their trainable parameters and floating-point buffers
(all-reduce sum / d); optimizer state stays each replica's own. Nothing crosses the data-parallel
link in between, which suits replicas in different sites joined by a slow link.

Cost. One averaging all-reduces each rank's trainable parameters in their stored (master) dtype:

    A_i = 2 (d - 1) / d * w * T_i / itemsize / dp_bandwidth   (w: bytes per parameter, memory's table)

and the model charges it as rank i's ("reduce", i) term at A_i / H per step, with no gradient
all-reduce: the predicted iteration time is the mean step time over H steps. Floating-point buffers
(BatchNorm's running statistics) are averaged too, in their own dtype: 2 (d - 1) / d * B_i /
dp_bandwidth more (B_i: the profile's buffer_bytes of rank i's units; older profiles do not count
them). Tied weights' gradient all-reduce spans the
holders of one replica only (CostOptions.tie_replicas).

Choosing H (`choose_sync_every`): a larger H is always cheaper in time and drifts further from the
per-step algorithm, so the planner takes the smallest H in 1..H_max whose averaging per step is
within a tolerance of the step's compute, A / H <= tolerance * C (A: the slowest rank's averaging,
C: the plan's step with a free data-parallel exchange), else H_max. H = 1 is the per-step gradient
all-reduce, whose time equals A (gradients and weights have the same dtype unsharded).
"""
from __future__ import annotations

import math
from typing import Optional

from planner.cost import memory as memory_model

DEFAULT_SYNC_OVERHEAD = 0.05  # the averaging's share of the step's compute that H may leave


def local_sgd_refusal(sync_every: int, shard: str, replicated: bool, placed: bool) -> Optional[str]:
    """Why local SGD averaging every `sync_every` steps cannot be planned or run with these options
    (one line: cause and fix), or None; the one rule CostOptions, plan files and `planner solve`
    check. Each replica trains a whole unsharded copy; replicated stages' lanes exchange gradients
    every step; a topology placement's exchange is planned per step (its ring latencies are charged
    every step, and the runtime holds its emulated share after every step)."""
    if sync_every <= 1:
        return None
    if shard != "none":
        return (f"local SGD (averaging every {sync_every} steps) needs --shard none: each replica trains a whole "
                f"unsharded copy (got --shard {shard})")
    if replicated:
        return ("local SGD does not run with replicated stages (their lanes exchange gradients every step); drop "
                "--replicate or use --local-sgd-max 1")
    if placed:
        return ("local SGD is not planned on a --topology placement yet (its replicas' exchange is planned every "
                "step, hierarchically); drop --topology or use --local-sgd-max 1")
    return None


def averaging_seconds_per_byte(precision: str, replicas: int, dtype: str, bandwidth: float) -> float:
    """Seconds one averaging takes per trainable profile byte (a `dtype` profile) over d replicas:
    the all-reduce of the stored parameters, 2 (d - 1) / d w bytes each, at `bandwidth`."""
    stored = memory_model.bytes_per_param(precision, "sgd").params  # unsharded: what each replica holds
    return buffer_averaging_seconds_per_byte(replicas, bandwidth) * stored / memory_model.param_itemsize(dtype)


def buffer_averaging_seconds_per_byte(replicas: int, bandwidth: float) -> float:
    """Seconds one averaging takes per floating-point buffer byte over d replicas: an all-reduce."""
    return 2.0 * (replicas - 1) / replicas / bandwidth if replicas > 1 else 0.0


def choose_sync_every(averaging_s: float, compute_s: float, h_max: int, tolerance: float) -> int:
    """The smallest H in 1..h_max with averaging_s / H <= tolerance * compute_s, else h_max."""
    if h_max < 1:
        raise ValueError(f"the bound on H must be at least 1 (got {h_max})")
    if not tolerance > 0:
        raise ValueError(f"the sync overhead tolerance must be positive (got {tolerance})")
    if averaging_s <= 0:
        return 1
    budget = tolerance * compute_s
    if budget <= 0:
        return h_max
    return max(1, min(h_max, math.ceil(averaging_s / budget - 1e-12)))
