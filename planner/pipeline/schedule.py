"""Pipeline schedules as data: one instruction list per rank, built by pure functions.

An `Action` names one thing a stage does for one micro-batch. The engine executes the list
in order; sends are non-blocking and receives block, so a list is deadlock-free when every
receive's matching send comes earlier in the sender's list than anything that waits on
the receiver (`check_schedule` verifies this by simulating the lists).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence

RECV_ACT = "recv_act"
FORWARD = "forward"
SEND_ACT = "send_act"
RECV_GRAD = "recv_grad"
BACKWARD = "backward"
SEND_GRAD = "send_grad"
OPTIMIZER_STEP = "optimizer_step"

# The schedules, the one list every command and check uses. One stage per pipeline rank (v = 1;
# also the ones replicated stages run with), then several ("chunked", v >= 2).
ONE_STAGE_SCHEDULES = ("1f1b", "gpipe")
CHUNKED_SCHEDULES = ("interleaved", "bfs")
SCHEDULES = ONE_STAGE_SCHEDULES + CHUNKED_SCHEDULES


@dataclass(frozen=True)
class Action:
    """One instruction: what to do, for which micro-batch, on which model chunk (plan stage)."""

    kind: str
    micro_batch: int = -1
    chunk: int = 0  # the global chunk (plan stage) index this action works on

    def __str__(self) -> str:
        if self.micro_batch < 0:
            return self.kind
        return f"{self.kind}({self.micro_batch},s{self.chunk})"


def _forward(chunk: int, num_chunks: int, i: int) -> List[Action]:
    actions = []
    if chunk > 0:
        actions.append(Action(RECV_ACT, i, chunk))
    actions.append(Action(FORWARD, i, chunk))
    if chunk < num_chunks - 1:
        actions.append(Action(SEND_ACT, i, chunk))
    return actions


def _backward(chunk: int, num_chunks: int, i: int) -> List[Action]:
    actions = []
    if chunk < num_chunks - 1:
        actions.append(Action(RECV_GRAD, i, chunk))
    actions.append(Action(BACKWARD, i, chunk))
    if chunk > 0:
        actions.append(Action(SEND_GRAD, i, chunk))
    return actions


def breadth_first(chunks: List[int], num_chunks: int, num_micro_batches: int) -> List[Action]:
    """GPipe, generalised to several chunks per rank ("bfs", looped breadth-first): every
    micro-batch through one chunk before the next chunk, then the backwards in reverse chunk
    order. With one chunk per rank this is GPipe: all forwards, then all backwards."""
    actions: List[Action] = []
    for g in chunks:
        for i in range(num_micro_batches):
            actions += _forward(g, num_chunks, i)
    for g in reversed(chunks):
        for i in range(num_micro_batches):
            actions += _backward(g, num_chunks, i)
    return actions + [Action(OPTIMIZER_STEP)]


def one_f_one_b(chunks: List[int], num_chunks: int, num_micro_batches: int,
                warmup: "int | None" = None) -> List[Action]:
    """1F1B (one chunk per rank): `warmup` forwards (default `one_f_one_b_warmups`: P − g − 1,
    clipped to m), then alternate one forward and one backward, then drain. Chunk g holds at
    most min(warmup + 1, m) micro-batches."""
    (g,) = chunks
    m = num_micro_batches
    warmup = one_f_one_b_warmups([1] * num_chunks, m)[g] if warmup is None else min(warmup, m)
    actions: List[Action] = []
    for i in range(warmup):
        actions += _forward(g, num_chunks, i)
    for i in range(m - warmup):
        actions += _forward(g, num_chunks, warmup + i)
        actions += _backward(g, num_chunks, i)
    for i in range(m - warmup, m):
        actions += _backward(g, num_chunks, i)
    return actions + [Action(OPTIMIZER_STEP)]


def interleaved(chunks: List[int], num_chunks: int, num_micro_batches: int) -> List[Action]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): v chunks per rank, looping placement.

    Forward k (k = 0 .. m·v − 1) of pipeline rank r runs local chunk (k // p) mod v on
    micro-batch (k // (p·v))·p + k mod p; backward k runs local chunk v − 1 − (k // p) mod v on
    the same micro-batch formula. Warm-up: `interleaved_warmup` forwards.
    Needs m divisible by p. Bubble (p − 1)/(v·m) of the ideal time.
    """
    v = len(chunks)
    p = num_chunks // v
    r = chunks[0]  # looping placement: local chunk 0 is global chunk r
    m = num_micro_batches
    total = m * v

    def forward_op(k: int) -> List[Action]:
        return _forward(chunks[(k // p) % v], num_chunks, (k // (p * v)) * p + k % p)

    def backward_op(k: int) -> List[Action]:
        return _backward(chunks[v - 1 - (k // p) % v], num_chunks, (k // (p * v)) * p + k % p)

    warmup = interleaved_warmup(r, p, v, m)
    actions: List[Action] = []
    for k in range(warmup):
        actions += forward_op(k)
    for k in range(total - warmup):
        actions += forward_op(warmup + k)
        actions += backward_op(k)
    for k in range(total - warmup, total):
        actions += backward_op(k)
    return actions + [Action(OPTIMIZER_STEP)]


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
    num_chunks, m = len(replicas), num_micro_batches
    warmups = one_f_one_b_warmups(replicas, m)
    lists: List[List[Action]] = []
    for g, r in enumerate(replicas):
        if name == "1f1b":
            order = one_f_one_b([g], num_chunks, m, warmup=warmups[g])
        else:
            order = breadth_first([g], num_chunks, m)
        for lane in range(r):
            lists.append([a for a in order if a.micro_batch < 0 or a.micro_batch % r == lane])
    return lists


def build_schedule(name: str, num_chunks: int, num_micro_batches: int, virtual_stages: int = 1,
                   chunk_device: "tuple | None" = None,
                   chunk_replicas: "Sequence[int] | None" = None) -> List[List[Action]]:
    """One instruction list per pipeline rank. `chunk_device[g]` is the rank running chunk g
    (default: looping placement g mod p, with p = num_chunks / virtual_stages); with
    `chunk_replicas` (r_g devices for stage g), one list per device of `replicated`."""
    if num_chunks < 1 or num_micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"need at least one stage and one micro-batch (got {num_chunks}, {num_micro_batches})")
    if chunk_replicas is not None and any(r != 1 for r in chunk_replicas):
        if len(chunk_replicas) != num_chunks or virtual_stages != 1 or name not in ONE_STAGE_SCHEDULES:
            raise ValueError("replicated stages run one stage per device with gpipe or 1f1b")
        if max(chunk_replicas) > num_micro_batches or min(chunk_replicas) < 1:
            raise ValueError(f"stage replicas {list(chunk_replicas)} need 1 <= r <= {num_micro_batches} "
                             "(the micro-batch count)")
        return replicated(name, chunk_replicas, num_micro_batches)
    if num_chunks % virtual_stages:
        raise ValueError(f"{num_chunks} stages do not divide into {virtual_stages} virtual stages per device")
    p = num_chunks // virtual_stages
    devices = tuple(chunk_device) if chunk_device is not None else tuple(g % p for g in range(num_chunks))
    per_rank = [[g for g in range(num_chunks) if devices[g] == r] for r in range(p)]
    if name == "gpipe" or name == "bfs":
        builder = breadth_first
    elif name == "1f1b":
        if virtual_stages != 1:
            raise ValueError("1f1b runs one stage per device; use 'interleaved' for several")
        builder = one_f_one_b
    elif name == "interleaved":
        looping = all(devices[g] == g % p for g in range(num_chunks))
        if not looping:
            raise ValueError("interleaved needs the looping placement: stage g on device g mod p")
        if num_micro_batches % p:
            raise ValueError(f"interleaved needs the number of micro-batches ({num_micro_batches}) to be a "
                             f"multiple of the pipeline depth ({p})")
        builder = interleaved
    else:
        raise ValueError(f"unknown schedule {name!r}; this runtime runs {', '.join(SCHEDULES)}")
    return [builder(chunks, num_chunks, num_micro_batches) for chunks in per_rank]


def max_in_flight(actions: List[Action]) -> int:
    """Most micro-batches whose forward has run and whose backward has not, at any point."""
    live = peak = 0
    for a in actions:
        if a.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind == BACKWARD:
            live -= 1
    return peak


def check_schedule(lists: List[List[Action]], num_micro_batches: int,
                   placement: "Callable[[int, int], int] | None" = None) -> None:
    """Raise ValueError unless the lists are complete and cannot deadlock.

    Every chunk must forward and backward each micro-batch exactly once, forward first, on one
    rank (with `placement`, the rank `placement(chunk, micro_batch)` that peers send to), and each
    rank must end with its optimizer step. Then all ranks are simulated: a send completes at
    once (non-blocking); a receive proceeds only once the matching send has been issued. If no
    rank can move while some have work left, the lists deadlock.
    """
    owner = {}  # (chunk, micro-batch) -> the rank that forwards it
    for r, actions in enumerate(lists):
        if not actions or actions[-1].kind != OPTIMIZER_STEP:
            raise ValueError(f"rank {r}: the optimizer step must come last")
        for a in actions:
            if a.kind == FORWARD:
                if (a.chunk, a.micro_batch) in owner:
                    raise ValueError(f"chunk {a.chunk}: forward({a.micro_batch}) runs on ranks "
                                     f"{owner[(a.chunk, a.micro_batch)]} and {r}")
                owner[(a.chunk, a.micro_batch)] = r
    chunks = sorted({g for g, _ in owner})
    if chunks != list(range(len(chunks))):
        raise ValueError(f"chunks {chunks} are not 0..{len(chunks) - 1}")
    for g in chunks:
        done = sorted(i for c, i in owner if c == g)
        if done != list(range(num_micro_batches)):
            raise ValueError(f"chunk {g}: forward runs micro-batches {done}, expected 0..{num_micro_batches - 1}")
    for r, actions in enumerate(lists):
        position = {}
        for j, a in enumerate(actions):
            if a.kind in (FORWARD, BACKWARD):
                if (a.kind, a.chunk, a.micro_batch) in position:
                    raise ValueError(f"rank {r} chunk {a.chunk}: {a.kind}({a.micro_batch}) runs twice")
                position[(a.kind, a.chunk, a.micro_batch)] = j
        for g in {g for (g, _), rank in owner.items() if rank == r}:
            forwards = sorted(i for (c, i), rank in owner.items() if c == g and rank == r)
            backwards = sorted(i for kind, c, i in position if kind == BACKWARD and c == g)
            if backwards != forwards:
                raise ValueError(f"rank {r} chunk {g}: backward runs micro-batches {backwards}, expected "
                                 f"{forwards} (those it forwards)")
            for i in forwards:
                if position[(FORWARD, g, i)] > position[(BACKWARD, g, i)]:
                    raise ValueError(f"rank {r} chunk {g}: backward({i}) before forward({i})")
        stray = [k for k in position if k[0] == BACKWARD and owner.get(k[1:]) != r]
        if stray:
            raise ValueError(f"rank {r} chunk {stray[0][1]}: backward({stray[0][2]}) without its forward here")
        if placement is not None:
            wrong = [a for a in actions if a.micro_batch >= 0 and placement(a.chunk, a.micro_batch) != r]
            if wrong:
                raise ValueError(f"rank {r} runs {wrong[0]}, which the topology places on rank "
                                 f"{placement(wrong[0].chunk, wrong[0].micro_batch)}")
    sent = set()  # (kind, receiving chunk, micro-batch)
    cursor = [0] * len(lists)
    while True:
        moved = False
        for r, actions in enumerate(lists):
            while cursor[r] < len(actions):
                a = actions[cursor[r]]
                if a.kind == RECV_ACT and (SEND_ACT, a.chunk, a.micro_batch) not in sent:
                    break
                if a.kind == RECV_GRAD and (SEND_GRAD, a.chunk, a.micro_batch) not in sent:
                    break
                if a.kind == SEND_ACT:
                    sent.add((SEND_ACT, a.chunk + 1, a.micro_batch))
                elif a.kind == SEND_GRAD:
                    sent.add((SEND_GRAD, a.chunk - 1, a.micro_batch))
                cursor[r] += 1
                moved = True
        if all(cursor[r] == len(actions) for r, actions in enumerate(lists)):
            return
        if not moved:
            stuck = {r: str(lists[r][cursor[r]]) for r in range(len(lists)) if cursor[r] < len(lists[r])}
            raise ValueError(f"schedule deadlocks: ranks wait at {stuck}")
