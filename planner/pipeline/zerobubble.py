"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): each backward split
into its input part I (what the previous stage waits for) and its weight part W (which nothing
waits for), the W's placed where a rank would otherwise wait.

`zb-h1` (one stage per rank, the paper's ZB-H1): rank r runs 1F1B's warm-up (P - r - 1 forwards),
then F, I pairs, each followed by the W of the micro-batch r places back (rank r delays its W's by
r micro-batches, which fill the waits of the cool-down), then the W's left. Each rank holds at most
min(P, m) micro-batches from forward to W: 1F1B's peak (its first stage's) on every rank, so the
later ranks hold more than under 1F1B (the cost model counts it). With forward, input and weight
backward one unit each, its bubble is P - 1 units, a third of 1F1B's 3 (P - 1).

`zb-v` (two stages per rank, V placement: rank r runs stages r and 2p - 1 - r, so the first and
the last stage share rank 0): a list scheduler, run once per shape with every F, I and W taking one
time unit and messages free, in which a rank that is free runs, of the actions whose inputs have
arrived,

1. an input backward (the oldest micro-batch first, then the later stage: the critical path);
2. else a forward, if the rank then holds at most 2p stage-micro-batches (each half a 1F1B stage's,
   so p of 1F1B's, as the paper's ZB-V) -- the later stage's forward first (it drains the V), then
   the oldest; a forward of the rank's first stage leaves room for one of its second (without it,
   rank 0 could fill up with first-stage forwards while micro-batch 0 still has to come back);
3. else the oldest pending W;

and at the end every W still pending. Deadlock-free by construction: the last stage's I needs only
its own forward, each I sends what the next one up the pipeline needs, and a W frees a held
micro-batch. planner.pipeline.check proves every list built.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from planner.pipeline.actions import Action, ActionKind

ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-v")
F, I, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def v_placement(pipeline_ranks: int) -> Tuple[int, ...]:
    """Stage g -> rank for zb-v's 2p stages: g for g < p, 2p - 1 - g after (rank 0 first and last)."""
    p = pipeline_ranks
    return tuple(g if g < p else 2 * p - 1 - g for g in range(2 * p))


def held_limits(name: str, num_stages: int, num_micro_batches: int) -> List[int]:
    """Per rank: the most micro-batches (of any of its stages) held from forward to W."""
    m = num_micro_batches
    if name == "zb-h1":
        return [min(num_stages, m) for g in range(num_stages)]
    p = num_stages // 2
    return [min(2 * p, 2 * m) for _ in range(p)]


def zero_bubble_orders(name: str, num_stages: int, num_micro_batches: int) -> List[List[Action]]:
    """Each rank's compute order (F, I, W actions) for `zb-h1` (one stage per rank) or `zb-v`."""
    if name == "zb-h1":
        return [_h1_order(r, num_stages, num_micro_batches) for r in range(num_stages)]
    if name != "zb-v":
        raise ValueError(f"unknown zero-bubble schedule {name!r}")
    if num_stages % 2:
        raise ValueError(f"zb-v runs two stages per device: {num_stages} stages is odd")
    return _v_orders(num_stages, num_micro_batches)


def _h1_order(r: int, num_stages: int, m: int) -> List[Action]:
    """ZB-H1 on rank (= stage) r of P (module docstring)."""
    warmup = min(num_stages - r - 1, m)
    order = [Action(F, i, r) for i in range(warmup)]
    weights = 0
    for k in range(m):
        if k + warmup < m:
            order.append(Action(F, k + warmup, r))
        order.append(Action(I, k, r))
        if k >= r:  # W's lag the I's by r micro-batches
            order.append(Action(W, weights, r))
            weights += 1
    return order + [Action(W, i, r) for i in range(weights, m)]


def _v_orders(num_stages: int, m: int) -> List[List[Action]]:
    """ZB-V's orders by the list scheduler of the module docstring."""
    S = num_stages
    ranks = v_placement(S // 2)
    P = max(ranks) + 1
    stages_of = [[g for g in range(S) if ranks[g] == r] for r in range(P)]
    limits = held_limits("zb-v", S, m)
    forward_at: Dict[Tuple[int, int], int] = {}  # (stage, mb) -> when its forward ended
    input_at: Dict[Tuple[int, int], int] = {}  # (stage, mb) -> when its input backward ended
    next_forward = {g: 0 for g in range(S)}
    next_input = {g: 0 for g in range(S)}
    pending_w: List[List[Tuple[int, int]]] = [[] for _ in range(P)]  # (mb, stage), oldest first
    held = [0] * P
    orders: List[List[Action]] = [[] for _ in range(P)]
    clock = [0] * P  # when each rank is free
    done = 0
    total = 3 * S * m

    def forward_ready(g: int, t: int) -> bool:
        i = next_forward[g]
        return i < m and (g == 0 or forward_at.get((g - 1, i), t + 1) <= t)

    def input_ready(g: int, t: int) -> bool:
        i = next_input[g]
        if i >= m or forward_at.get((g, i), t + 1) > t:
            return False
        return g == S - 1 or input_at.get((g + 1, i), t + 1) <= t

    def choose(r: int, t: int):
        mine = stages_of[r]
        inputs = [g for g in mine if input_ready(g, t)]
        if inputs:
            g = min(inputs, key=lambda g: (next_input[g], -g))
            return I, g, next_input[g]
        room = limits[r] - held[r]
        forwards = [g for g in mine if forward_ready(g, t) and (room >= 2 or (room == 1 and g == mine[-1]))]
        if forwards:
            g = max(forwards, key=lambda g: (g == mine[-1], -next_forward[g]))
            return F, g, next_forward[g]
        if pending_w[r]:
            i, g = pending_w[r][0]
            return W, g, i
        return None

    # every action takes one unit, so time runs in whole units; what ends at t is visible at t
    t = 0
    while done < total:
        if t > 4 * total + 4 * S:
            raise ValueError(f"zb-v: the orders cannot finish with {S} stages and {m} micro-batches")
        for r in range(P):
            if clock[r] > t:
                continue
            picked = choose(r, t)
            if picked is None:
                continue
            kind, g, i = picked
            orders[r].append(Action(kind, i, g))
            clock[r] = t + 1
            done += 1
            if kind is F:
                forward_at[(g, i)] = t + 1
                next_forward[g] += 1
                held[r] += 1
            elif kind is I:
                input_at[(g, i)] = t + 1
                next_input[g] += 1
                pending_w[r].append((i, g))
            else:
                pending_w[r].pop(0)
                held[r] -= 1
        t += 1
    return orders
