"""What a message costs in a pipeline's rhythm: two processes on this host run the instruction
lists of a two-stage 1F1B step (planner.pipeline.schedule, the lists the runtime executes) with the
same stand-in compute on both, and the time the step takes beyond its compute, per message on its
critical path, is the one-way latency the messages met.

Why measure it: a ping-pong keeps both processes exchanging back to back, while a pipeline's ranks
compute between messages. On the shared 2-core VM this project is developed on, two balanced stages
paid about a millisecond per message over gloo where the ping-pong measured under 100 us, and the
same lists with one stage a third faster paid nothing measurable (BENCHMARKS.md, "Small
micro-batches"): the cost came with exchanges both sides wait on at once, a rank sleeping in gloo's
wait. Through the runtime's shared memory (runtime/shared_memory.py, polled) it is 43 us. A plan's
latency stays the ping-pong's; the rhythm's is recorded in the profile (`link.rhythm`) and printed,
as the bound of what a balanced split of this model may pay per message on this host.

The lists are run as the runtime runs them: the communication actions of one batch posted together
(batch_isend_irecv), a batch of sends only left in flight until the rank's next batch. With forward
F and backward B per stage and micro-batch, m >= 4 micro-batches and a one-way latency lam <= F + B
per message, planner.cost's step graph of these lists gives

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
    low, high = 0.0, step_s - free  # at least one operation on the path: high is enough
    while step(high) < step_s:
        high *= 2
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


def stand_in(forward_s: float, backward_s: float) -> Tuple[float, float]:
    """The stand-in compute timed for (forward, backward): each capped at MAX_COMPUTE_S."""
    return min(forward_s, MAX_COMPUTE_S), min(backward_s, MAX_COMPUTE_S)


def rhythm_steps(rank: int, forward_s: float, backward_s: float, post,
                 micro_batches: int = MICRO_BATCHES) -> List[float]:
    """Seconds per step of the lists with (forward_s, backward_s) of compute (`stand_in`'s, capped by
    the caller), one per timed step, on rank 0 (rank 1 runs the same call and
    returns []). Both ranks of the default process group (world size 2) must call it together.
    Messages go through `post` (planner.profile.link.dist_post or the runtime's transport, which
    runtime.link_probe hands in)."""
    from planner.pipeline.actions import SENDS, ActionKind
    from planner.pipeline.schedule import build_schedule
    from planner.pipeline.stepgraph import batches_of

    compute = StandInCompute()
    peer = 1 - rank
    items = batches_of(build_schedule("1f1b", 2, micro_batches)[rank])  # computes, and batches as tuples
    cycle = (micro_batches + 1) * (forward_s + backward_s) + 1e-3
    steps = WARMUP_STEPS + max(MIN_STEPS, min(50, int(BUDGET_S / cycle)))
    times: List[float] = []
    for step in range(steps):
        started = time.perf_counter()
        in_flight: List = []  # a batch of sends only, posted and not yet waited for
        for item in items:
            if not isinstance(item, tuple):
                compute(forward_s if item.kind is ActionKind.FORWARD else backward_s)
                continue
            for work in in_flight:
                work.wait()
            works = post([(a.kind in SENDS, torch.zeros(64), peer, 0) for a in item])
            in_flight = works if all(a.kind in SENDS for a in item) else []
            if not in_flight:
                for work in works:
                    work.wait()
        for work in in_flight:
            work.wait()
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - started)
    # rank 0 starts its next step when its last backward ends, rank 1 waits for that step's first
    # activation: steps follow each other with no barrier, as a run's do
    return times if rank == 0 else []


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
