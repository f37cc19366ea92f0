"""Checking instruction lists before anything runs: complete, placed where the topology says, and
unable to deadlock under NCCL's rules (planner.pipeline.stepgraph: batches posted together and
waited for entirely, a batch of sends only before the rank's next batch, a send done only with its
receive, a rank's operations completed in issue order, a pair's messages matched in order)."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from planner.pipeline.actions import COMPUTE_KINDS, SENDS, Action, ActionKind, message_of, peer_stage
from planner.pipeline.stepgraph import StepGraph

Placement = Callable[[int, int], int]  # (stage, micro-batch) -> the pipeline rank running it


def check_schedule(lists: List[List[Action]], num_micro_batches: int, placement: Optional[Placement] = None) -> None:
    """Raise ValueError unless the lists are complete and cannot deadlock.

    Every stage must forward and backward each micro-batch exactly once, forward first, on one
    rank (with `placement`, the rank `placement(stage, micro_batch)` that peers send to), and each
    rank must end with its optimizer step. Then NCCL's rules: each pair of ranks posts its messages
    in the same order on both sides, and the lists compile into a step graph (every batch of
    messages meets its peers' batches) rather than stopping with ranks waiting on each other.
    """
    owner = _forward_owners(lists)
    _check_every_micro_batch_forwarded(owner, num_micro_batches)
    for r, actions in enumerate(lists):
        _check_rank(r, actions, owner, placement)
    check_messages(lists, placement if placement is not None else (lambda g, i: owner[(g, i)]))


def check_messages(lists: List[List[Action]], placement: Placement) -> None:
    """Raise ValueError unless the lists' messages meet under NCCL's rules: each pair of ranks posts them in
    the same order on both sides (`check_pair_order`), and the lists compile into a step graph."""
    check_pair_order(lists, placement)
    StepGraph(lists, placement)  # DeadlockError (a ValueError) says where the ranks wait


def _forward_owners(lists: List[List[Action]]) -> Dict[Tuple[int, int], int]:
    """(stage, micro-batch) -> the rank that forwards it; each rank ends with its optimizer step."""
    owner: Dict[Tuple[int, int], int] = {}
    for r, actions in enumerate(lists):
        if not actions or actions[-1].kind is not ActionKind.OPTIMIZER_STEP:
            raise ValueError(f"rank {r}: the optimizer step must come last")
        for a in actions:
            if a.kind is ActionKind.FORWARD:
                if (a.stage, a.micro_batch) in owner:
                    raise ValueError(f"stage {a.stage}: forward({a.micro_batch}) runs on ranks "
                                     f"{owner[(a.stage, a.micro_batch)]} and {r}")
                owner[(a.stage, a.micro_batch)] = r
    return owner


def _check_every_micro_batch_forwarded(owner: Dict[Tuple[int, int], int], num_micro_batches: int) -> None:
    stages = sorted({g for g, _ in owner})
    if stages != list(range(len(stages))):
        raise ValueError(f"stages {stages} are not 0..{len(stages) - 1}")
    for g in stages:
        done = sorted(i for s, i in owner if s == g)
        if done != list(range(num_micro_batches)):
            raise ValueError(f"stage {g}: forward runs micro-batches {done}, expected 0..{num_micro_batches - 1}")


def _check_rank(r: int, actions: List[Action], owner: Dict[Tuple[int, int], int],
                placement: Optional[Placement]) -> None:
    """Rank r runs each of its forwards and backwards once, every backward after its forward and
    only of what it forwarded, and (with `placement`) only what the topology puts on it. A backward
    is one `backward`, or (zero-bubble) one `backward_input` and then one `backward_weight`."""
    position: Dict[Tuple[ActionKind, int, int], int] = {}
    for j, a in enumerate(actions):
        if a.kind in COMPUTE_KINDS:
            if (a.kind, a.stage, a.micro_batch) in position:
                raise ValueError(f"rank {r} stage {a.stage}: {a.kind.value}({a.micro_batch}) runs twice")
            position[(a.kind, a.stage, a.micro_batch)] = j
    whole, split = ActionKind.BACKWARD, (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    for g in {g for (g, _), rank in owner.items() if rank == r}:
        forwards = sorted(i for (s, i), rank in owner.items() if s == g and rank == r)
        for kind in (whole,) + split:
            done = sorted(i for k, s, i in position if k is kind and s == g)
            if done and done != forwards:
                raise ValueError(f"rank {r} stage {g}: {kind.value} runs micro-batches {done}, expected "
                                 f"{forwards} (those it forwards)")
        for i in forwards:
            at = [position.get((k, g, i)) for k in (ActionKind.FORWARD, whole) + split]
            if at[1] is None and (at[2] is None or at[3] is None):
                raise ValueError(f"rank {r} stage {g}: micro-batch {i} has no backward (one backward, or "
                                 "backward_input then backward_weight)")
            if at[1] is not None and at[2] is not None:
                raise ValueError(f"rank {r} stage {g}: micro-batch {i} runs both a backward and a backward_input")
            ordered = [x for x in at if x is not None]
            if ordered != sorted(ordered):
                raise ValueError(f"rank {r} stage {g}: micro-batch {i}'s forward, backward_input and "
                                 "backward_weight run out of order")
    stray = [k for k in position if k[0] is not ActionKind.FORWARD and owner.get(k[1:]) != r]
    if stray:
        raise ValueError(f"rank {r} stage {stray[0][1]}: {stray[0][0].value}({stray[0][2]}) without its forward here")
    if placement is not None:
        wrong = [a for a in actions if a.micro_batch >= 0 and placement(a.stage, a.micro_batch) != r]
        if wrong:
            raise ValueError(f"rank {r} runs {wrong[0]}, which the topology places on rank "
                             f"{placement(wrong[0].stage, wrong[0].micro_batch)}")


def check_pair_order(lists: List[List[Action]], placement: Placement) -> None:
    """Raise ValueError unless every rank posts its sends to a peer in the order the peer posts the
    matching receives (NCCL matches a pair's messages by order, not by tag)."""
    sent: Dict[Tuple[int, int], List[Tuple[str, int, int]]] = {}
    received: Dict[Tuple[int, int], List[Tuple[str, int, int]]] = {}
    for r, actions in enumerate(lists):
        for a in actions:
            if a.kind in SENDS:
                sent.setdefault((r, placement(peer_stage(a), a.micro_batch)), []).append(message_of(a))
            elif a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                received.setdefault((placement(peer_stage(a), a.micro_batch), r), []).append(message_of(a))
    for pair in sorted(set(sent) | set(received)):
        mine, theirs = sent.get(pair, []), received.get(pair, [])
        if mine != theirs:
            k = next((k for k, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
            raise ValueError(f"ranks {pair[0]} -> {pair[1]}: message {k} is {mine[k] if k < len(mine) else 'none'} "
                             f"on the sender and {theirs[k] if k < len(theirs) else 'none'} on the receiver; "
                             "a pair's messages must be posted in the same order on both sides")
