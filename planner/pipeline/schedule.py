"""Pipeline schedules as data: one instruction list per pipeline rank, built by pure functions.

A schedule decides the order of each rank's forwards and backwards (the builders below);
planner.pipeline.messages adds the messages between ranks, one rule for every schedule but
replicated stages' 1F1B (planner.pipeline.pulled), so that the lists cannot deadlock under NCCL's
rules (planner.pipeline.check proves it for each plan).
The engine executes the lists in order; planner.pipeline.stepgraph says what that costs.
"""
from __future__ import annotations

import functools

from typing import List, Sequence

from planner.pipeline.actions import Action, ActionKind  # noqa: F401  (the lists' vocabulary, re-exported)
from planner.pipeline.check import check_messages
from planner.pipeline.messages import place_messages
from planner.pipeline.pulled import place_pulled_messages
from planner.pipeline.stepgraph import StepGraph
from planner.pipeline.zerobubble import ZERO_BUBBLE_SCHEDULES, v_placement, zero_bubble_orders

# The schedules, the one list every command and check uses. One stage per pipeline rank (v = 1;
# also the ones replicated stages run with), then several ("multi-stage", any v >= 2), then the
# zero-bubble ones (planner.pipeline.zerobubble: zb-h1 with v = 1, zb-v with v = 2 in a V).
ONE_STAGE_SCHEDULES = ("1f1b", "gpipe")
MULTI_STAGE_SCHEDULES = ("interleaved", "bfs")
SCHEDULES = ONE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES + ZERO_BUBBLE_SCHEDULES
# the most micro-batches a step may have: the lists hold 2 m actions per stage, and every plan's
# time is their simulation (a step of 10^5 micro-batches took minutes to plan and gigabytes to hold)
MAX_MICRO_BATCHES = 4096


def schedule_virtual_stages(name: str) -> "int | None":
    """The stages per device a schedule runs with, when it fixes them (None: any v >= 2)."""
    return None if name in MULTI_STAGE_SCHEDULES else 2 if name == "zb-v" else 1


@functools.lru_cache(maxsize=256)  # asked per action and per stage by the cost model's hot paths
def stage_placement(name: str, num_stages: int, virtual_stages: int = 1) -> tuple:
    """Stage g -> the pipeline rank running it: the V for zb-v, else looping (g mod p)."""
    if name == "zb-v" and num_stages % 2 == 0:
        return v_placement(num_stages // 2)
    p = max(1, num_stages // max(1, virtual_stages))
    return tuple(g % p for g in range(num_stages))


def _forward(stage: int, num_stages: int, i: int) -> List[Action]:
    return [Action(ActionKind.FORWARD, i, stage)]


def _backward(stage: int, num_stages: int, i: int) -> List[Action]:
    return [Action(ActionKind.BACKWARD, i, stage)]


def breadth_first(stages: List[int], num_stages: int, num_micro_batches: int) -> List[Action]:
    """GPipe, generalised to several stages per rank ("bfs", looped breadth-first): every
    micro-batch through one stage before the next stage, then the backwards in reverse stage
    order. With one stage per rank this is GPipe: all forwards, then all backwards."""
    actions: List[Action] = []
    for g in stages:
        for i in range(num_micro_batches):
            actions += _forward(g, num_stages, i)
    for g in reversed(stages):
        for i in range(num_micro_batches):
            actions += _backward(g, num_stages, i)
    return actions


def one_f_one_b(stages: List[int], num_stages: int, num_micro_batches: int,
                warmup: "int | None" = None) -> List[Action]:
    """1F1B (one stage per rank): `warmup` forwards (default `one_f_one_b_warmups`: P − g − 1,
    clipped to m), then alternate one forward and one backward, then drain. Stage g holds at
    most min(warmup + 1, m) micro-batches."""
    (g,) = stages
    m = num_micro_batches
    warmup = one_f_one_b_warmups([1] * num_stages, m)[g] if warmup is None else min(warmup, m)
    actions: List[Action] = []
    for i in range(warmup):
        actions += _forward(g, num_stages, i)
    for i in range(m - warmup):
        actions += _forward(g, num_stages, warmup + i)
        actions += _backward(g, num_stages, i)
    for i in range(m - warmup, m):
        actions += _backward(g, num_stages, i)
    return actions


def interleaved(stages: List[int], num_stages: int, num_micro_batches: int) -> List[Action]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): v stages per rank, looping placement.

    Forward k (k = 0 .. m·v − 1) of pipeline rank r runs local stage (k // p) mod v on
    micro-batch (k // (p·v))·p + k mod p; backward k runs local stage v − 1 − (k // p) mod v on
    the same micro-batch formula. Warm-up: `interleaved_warmup` forwards.
    Needs m divisible by p. Bubble (p − 1)/(v·m) of the ideal time.
    """
    v = len(stages)
    p = num_stages // v
    r = stages[0]  # looping placement: local stage 0 is global stage r
    m = num_micro_batches
    total = m * v

    def forward_op(k: int) -> List[Action]:
        return _forward(stages[(k // p) % v], num_stages, (k // (p * v)) * p + k % p)

    def backward_op(k: int) -> List[Action]:
        return _backward(stages[v - 1 - (k // p) % v], num_stages, (k // (p * v)) * p + k % p)

    warmup = interleaved_warmup(r, p, v, m)
    actions: List[Action] = []
    for k in range(warmup):
        actions += forward_op(k)
    for k in range(total - warmup):
        actions += forward_op(warmup + k)
        actions += backward_op(k)
    for k in range(total - warmup, total):
        actions += backward_op(k)
    return actions


def last_stage_warmup(replicas: int) -> int:
    """1F1B warm-up forwards of the last stage's unreplicated order: one per replica beyond the first."""
    return replicas - 1


def warmup_before(next_warmup: int, replicas: int, next_replicas: int) -> int:
    """1F1B warm-up w_g of a stage with r_g replicas before a stage with r_{g+1} and warm-up w_{g+1}:

        w_g = w_{g+1} + max(r_g, r_{g+1})

    Without replicas this is 1F1B's P − g − 1. A stage feeding r_{g+1} replicas keeps that many
    more micro-batches going, so that each replica finds its next forward ready; with the
    alternative w_g = sum_{h>=g} r_h − 1, a wide stage behind a narrow one serialises (its
    replica j's backward waits for a forward that upstream releases only after backward j − 2;
    BENCHMARKS.md has the measurements). Non-increasing along the pipeline, so deadlock-free."""
    return next_warmup + max(replicas, next_replicas)


def one_f_one_b_warmups(replicas: Sequence[int], num_micro_batches: int) -> List[int]:
    """The 1F1B warm-up forwards w_g of every stage (replicated stages: of its unreplicated order,
    which each replica filters), clipped to m: `last_stage_warmup`, then `warmup_before` backwards.
    The schedule builders and the cost model's in-flight counts both use this rule."""
    warmups = [0] * len(replicas)
    warmups[-1] = last_stage_warmup(replicas[-1])
    for g in range(len(replicas) - 2, -1, -1):
        warmups[g] = warmup_before(warmups[g + 1], replicas[g], replicas[g + 1])
    return [min(w, num_micro_batches) for w in warmups]


def interleaved_warmup(pipeline_rank: int, pipeline_ranks: int, virtual_stages: int, num_micro_batches: int) -> int:
    """Interleaved 1F1B's warm-up forwards on pipeline rank r (Megatron-LM's rule), clipped to the
    m·v forwards the rank runs: min(2·(p − r − 1) + (v − 1)·p, m·v)."""
    p, v = pipeline_ranks, virtual_stages
    return min(2 * (p - pipeline_rank - 1) + (v - 1) * p, num_micro_batches * v)


def replicated(name: str, replicas: Sequence[int], num_micro_batches: int) -> List[List[Action]]:
    """Stages with r_g >= 1 devices each (one stage per device): one list per device, stage by stage.

    Stage g's order is the unreplicated one (GPipe; or 1F1B with the warm-ups of
    `one_f_one_b_warmups`), and its replica j runs the subsequence of micro-batches i ≡ j (mod r_g).
    Deadlock-free: one global order that executes the unreplicated lists (warm-ups
    non-increasing along the pipeline) executes these too, as each list is a subsequence of its
    stage's. Replica j of stage g holds at most ceil(min(w_g + 1, m) / r_g) micro-batches (1F1B),
    ceil(m / r_g) (GPipe)."""
    num_stages, m = len(replicas), num_micro_batches
    warmups = one_f_one_b_warmups(replicas, m)
    lists: List[List[Action]] = []
    for g, r in enumerate(replicas):
        if name == "1f1b":
            order = one_f_one_b([g], num_stages, m, warmup=warmups[g])
        else:
            order = breadth_first([g], num_stages, m)
        for lane in range(r):
            lists.append([a for a in order if a.micro_batch < 0 or a.micro_batch % r == lane])
    return lists


def build_schedule(name: str, num_stages: int, num_micro_batches: int, virtual_stages: int = 1,
                   stage_rank: "tuple | None" = None,
                   stage_replicas: "Sequence[int] | None" = None) -> List[List[Action]]:
    """One instruction list per pipeline rank: the schedule's compute order with the messages placed
    (planner.pipeline.messages) and the optimizer step last. `stage_rank[g]` is the pipeline rank
    running stage g (default: looping placement g mod p, with p = num_stages / virtual_stages);
    with `stage_replicas` (r_g ranks for stage g), one list per rank of `replicated`."""
    if num_stages < 1 or num_micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"need at least one stage and one micro-batch (got {num_stages}, {num_micro_batches})")
    if stage_replicas is not None and any(r != 1 for r in stage_replicas):
        if len(stage_replicas) != num_stages or virtual_stages != 1 or name not in ONE_STAGE_SCHEDULES:
            raise ValueError("replicated stages run one stage per device with gpipe or 1f1b")
        if max(stage_replicas) > num_micro_batches or min(stage_replicas) < 1:
            raise ValueError(f"stage replicas {list(stage_replicas)} need 1 <= r <= {num_micro_batches} "
                             "(the micro-batch count)")
        offsets = [sum(stage_replicas[:g]) for g in range(num_stages)]
        return _replicated_lists(replicated(name, stage_replicas, num_micro_batches), stage_replicas,
                                 lambda g, i: offsets[g] + i % stage_replicas[g], pulled=name == "1f1b")
    if num_stages % virtual_stages:
        raise ValueError(f"{num_stages} stages do not divide into {virtual_stages} virtual stages per device")
    p = num_stages // virtual_stages
    ranks = tuple(stage_rank) if stage_rank is not None else stage_placement(name, num_stages, virtual_stages)
    per_rank = [[g for g in range(num_stages) if ranks[g] == r] for r in range(p)]
    if name in ZERO_BUBBLE_SCHEDULES:
        if virtual_stages != schedule_virtual_stages(name):
            raise ValueError(f"{name} runs {schedule_virtual_stages(name)} stage(s) per device, not {virtual_stages}")
        if ranks != stage_placement(name, num_stages, virtual_stages):
            raise ValueError(f"{name} needs its own placement: stage g on device "
                             f"{list(stage_placement(name, num_stages, virtual_stages))}[g]")
        orders = zero_bubble_orders(name, num_stages, num_micro_batches)
        return place_messages(orders, num_stages, lambda g, i: ranks[g])
    if name == "gpipe" or name == "bfs":
        builder = breadth_first
    elif name == "1f1b":
        if virtual_stages != 1:
            raise ValueError("1f1b runs one stage per device; use 'interleaved' for several")
        builder = one_f_one_b
    elif name == "interleaved":
        looping = all(ranks[g] == g % p for g in range(num_stages))
        if not looping:
            raise ValueError("interleaved needs the looping placement: stage g on device g mod p")
        if num_micro_batches % p:
            raise ValueError(f"interleaved needs the number of micro-batches ({num_micro_batches}) to be a "
                             f"multiple of the pipeline depth ({p})")
        builder = interleaved
    else:
        raise ValueError(f"unknown schedule {name!r}; this runtime runs {', '.join(SCHEDULES)}")
    orders = [builder(stages, num_stages, num_micro_batches) for stages in per_rank]
    return place_messages(orders, num_stages, lambda g, i: ranks[g])


def _replicated_lists(orders: List[List[Action]], stage_replicas: Sequence[int], position,
                      pulled: bool = False) -> List[List[Action]]:
    """Messages placed for replicated stages: a replicated stage's ranks are busy r_g times as long
    per micro-batch, so the replay weighs stage g by r_g. 1F1B (`pulled`): planner.pipeline.pulled's
    rule (receive when needed, send just before the receiver asks), whose results cannot deadlock (its
    docstring); each is checked all the same (ValueError were one ever refused). GPipe: of the two
    placements of planner.pipeline.messages (senders post at once, or wait for the busy receiver's
    point), the one whose step under those weights and NCCL's rules is shorter (the first on a tie)."""
    S = len(stage_replicas)
    weights = [float(r) for r in stage_replicas]
    if pulled:
        lists = place_pulled_messages(orders, S, position, weights)
        check_messages(lists, position)
        return lists
    value = {("forward", g): w for g, w in enumerate(weights)}
    value.update({("backward", g): 2 * w for g, w in enumerate(weights)})
    best = None
    for wait in (False, True):
        lists = place_messages(orders, S, position, weights=weights, wait_for_receiver=wait)
        step = StepGraph(lists, position).run(value).step_s
        if best is None or step < best[0] - 1e-9:
            best = (step, lists)
    return best[1]


def max_in_flight(actions: List[Action]) -> int:
    """Most micro-batches whose forward has run and whose backward (its weight part, when split)
    has not, at any point."""
    live = peak = 0
    for a in actions:
        if a.kind == ActionKind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            live -= 1
    return peak
