"""What a message costs in a pipeline's rhythm: two processes on this host run the instruction
lists of a two-stage 1F1B step (planner.pipeline.schedule, the lists the runtime executes) with the
same stand-in compute on both, every batch of messages through the runtime's engine
(runtime.message_rhythm, which the link probe's processes run), and the time the step takes beyond
its compute is read two ways: as the per-operation cost a plan charges (`rhythm_message_cost`,
charged as `link.message_s`) and as a one-way latency per message on the critical path
(`rhythm_latency`, recorded and printed).

Why measure it: a ping-pong keeps both processes exchanging back to back, while a pipeline's ranks
compute between messages, and after compute a message's Python (the engine's packing, the post, the
completion) costs several times what it costs hot (BENCHMARKS.md, "Messages between computations").
Over gloo the cost came with exchanges both sides wait on at once, a rank sleeping in gloo's wait
(BENCHMARKS.md, "Small micro-batches").

With forward F and backward B per stage and micro-batch, m >= 4 micro-batches and a one-way latency
lam <= F + B per message, planner.cost's step graph of these lists gives

    step = (m + 1)(F + B) + (m + 2) lam

(each steady cycle of the last stage waits for an activation that left one cycle of rank 0 after
the gradient that released it: one latency per cycle, tests/profile/test_rhythm.py), so
lam = (step - (m + 1)(F + B)) / (m + 2).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Tuple

import torch

MICRO_BATCHES = 8
BUDGET_S = 2.0  # timed seconds at most (the steps are repeated within it, at least MIN_STEPS)
MIN_STEPS = 5
WARMUP_STEPS = 2
MAX_COMPUTE_S = 0.02  # per forward or backward: longer compute is timed at this (the latency is per message)


def rhythm_latency(step_s: float, forward_s: float, backward_s: float, micro_batches: int = MICRO_BATCHES) -> float:
    """lam from a measured step of the lists (module docstring); >= 0."""
    if micro_batches < 4:
        raise ValueError("the rhythm needs at least four micro-batches")
    compute = (micro_batches + 1) * (forward_s + backward_s)
    return max(0.0, (step_s - compute) / (micro_batches + 2))


def rhythm_message_cost(step_s: float, forward_s: float, backward_s: float, latency_s: float,
                        micro_batches: int = MICRO_BATCHES) -> float:
    """The cost per operation (`message_s`: each message once on its sender's side, once on its
    receiver's) with which planner.cost's step graph of the two-stage 1F1B lists, stages of
    `forward_s` / `backward_s` and messages of `latency_s`, takes `step_s`: what the lists run
    through the engine measured (runtime.message_rhythm), read the way a plan charges it. The step
    graph's step grows with the per-operation cost (piecewise linearly), so bisection finds it;
    0 where the step is no longer than the lists at no cost (noise)."""
    from planner.pipeline.schedule import build_schedule
    from planner.pipeline.simulate import simulate

    if micro_batches < 4:
        raise ValueError("the rhythm needs at least four micro-batches")
    lists = build_schedule("1f1b", 2, micro_batches)
    value = {("forward", 0): forward_s, ("forward", 1): forward_s, ("backward", 0): backward_s,
             ("backward", 1): backward_s, ("act", 0): latency_s, ("grad", 0): latency_s}

    def step(message_s: float) -> float:
        return simulate(lists, {**value, ("message",): message_s}, lambda g, i: g)[0].step_s

    free = step(0.0)
    if not step_s > free * (1 + 1e-9):
        return 0.0
    # at least one operation lies on the longest path, so step(x) >= free + x and step(high) >= step_s
    low, high = 0.0, step_s - free
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) < step_s else (low, middle)
    return high


class StandInCompute:
    """Stand-in compute: small matmuls until a deadline (a rank computes on its own thread)."""

    def __init__(self) -> None:
        self.a, self.b = torch.randn(64, 64), torch.randn(64, 64)

    def __call__(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            torch.mm(self.a, self.b)


def rhythm_step_count(forward_s: float, backward_s: float, micro_batches: int = MICRO_BATCHES) -> int:
    """Steps to run (WARMUP_STEPS untimed first): at least MIN_STEPS timed, at most 50, within BUDGET_S."""
    cycle = (micro_batches + 1) * (forward_s + backward_s) + 1e-3
    return WARMUP_STEPS + max(MIN_STEPS, min(50, int(BUDGET_S / cycle)))


def stand_in(forward_s: float, backward_s: float) -> Tuple[float, float]:
    """The stand-in compute timed for (forward, backward): each capped at MAX_COMPUTE_S."""
    return min(forward_s, MAX_COMPUTE_S), min(backward_s, MAX_COMPUTE_S)


def summarise(times: List[float], forward_s: float, backward_s: float,
              micro_batches: int = MICRO_BATCHES) -> Dict[str, float]:
    """The rhythm's record in a profile's link: the stand-in compute timed (`stand_in`'s), the median
    step and lam."""
    step = statistics.median(times)
    return {"forward_s": forward_s, "backward_s": backward_s, "micro_batches": micro_batches,
            "steps": len(times), "step_s": step,
            "latency_s": rhythm_latency(step, forward_s, backward_s, micro_batches)}


def rhythm_compute(profile) -> Tuple[float, float]:
    """(forward s, backward s) of one of two equal stages per micro-batch at the profile's smallest
    micro-batch size: the compute between a two-stage run's messages."""
    b = min(profile.micro_batch_sizes)
    forward = sum(unit.forward_s[b] for unit in profile.units)
    backward = sum(unit.backward_s[b] for unit in profile.units)
    return forward / 2, backward / 2
