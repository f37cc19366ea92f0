"""Pipeline schedules as data: one instruction list per rank, built by pure functions.

An `Action` names one thing a stage does for one micro-batch. The engine executes the list
in order; sends are non-blocking and receives block, so a list is deadlock-free when every
receive's matching send comes earlier in the sender's list than anything that waits on
the receiver (`check_schedule` verifies this by simulating the lists).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

RECV_ACT = "recv_act"
FORWARD = "forward"
SEND_ACT = "send_act"
RECV_GRAD = "recv_grad"
BACKWARD = "backward"
SEND_GRAD = "send_grad"
OPTIMIZER_STEP = "optimizer_step"

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    """One instruction. `chunk` is the model chunk (virtual stage) on this rank; 0 unless the
    schedule places several chunks per device (interleaved, bfs)."""

    kind: str
    micro_batch: int = -1
    chunk: int = 0

    def __str__(self) -> str:
        if self.micro_batch < 0:
            return self.kind
        return f"{self.kind}({self.micro_batch})" if self.chunk == 0 else f"{self.kind}({self.micro_batch},c{self.chunk})"


def _forward(stage: int, num_stages: int, i: int) -> List[Action]:
    actions = []
    if stage > 0:
        actions.append(Action(RECV_ACT, i))
    actions.append(Action(FORWARD, i))
    if stage < num_stages - 1:
        actions.append(Action(SEND_ACT, i))
    return actions


def _backward(stage: int, num_stages: int, i: int) -> List[Action]:
    actions = []
    if stage < num_stages - 1:
        actions.append(Action(RECV_GRAD, i))
    actions.append(Action(BACKWARD, i))
    if stage > 0:
        actions.append(Action(SEND_GRAD, i))
    return actions


def gpipe(stage: int, num_stages: int, num_micro_batches: int) -> List[Action]:
    """All forwards, then all backwards (in micro-batch order), then one optimizer step."""
    actions: List[Action] = []
    for i in range(num_micro_batches):
        actions += _forward(stage, num_stages, i)
    for i in range(num_micro_batches):
        actions += _backward(stage, num_stages, i)
    return actions + [Action(OPTIMIZER_STEP)]


def one_f_one_b(stage: int, num_stages: int, num_micro_batches: int) -> List[Action]:
    """1F1B: min(S − s − 1, m) warm-up forwards, then alternate one forward and one backward,
    then drain the remaining backwards. Stage s holds at most min(S − s, m) micro-batches."""
    m = num_micro_batches
    warmup = min(num_stages - stage - 1, m)
    actions: List[Action] = []
    for i in range(warmup):
        actions += _forward(stage, num_stages, i)
    for i in range(m - warmup):
        actions += _forward(stage, num_stages, warmup + i)
        actions += _backward(stage, num_stages, i)
    for i in range(m - warmup, m):
        actions += _backward(stage, num_stages, i)
    return actions + [Action(OPTIMIZER_STEP)]


def build_schedule(name: str, num_stages: int, num_micro_batches: int) -> List[List[Action]]:
    """One instruction list per stage."""
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch (got {num_stages}, {num_micro_batches})")
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b}
    if name not in builders:
        raise ValueError(f"unknown schedule {name!r}; this runtime runs {', '.join(SCHEDULES)}")
    return [builders[name](s, num_stages, num_micro_batches) for s in range(num_stages)]


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


def check_schedule(lists: List[List[Action]], num_micro_batches: int) -> None:
    """Raise ValueError unless the lists are complete and cannot deadlock.

    Simulates all ranks: a send completes at once (non-blocking); a receive proceeds only when
    the matching send has been issued. If no rank can move and some have work left, it is a
    deadlock. Also checks every micro-batch is forwarded and backwarded exactly once per stage,
    forward before backward, and the optimizer step comes last.
    """
    num_stages = len(lists)
    for s, actions in enumerate(lists):
        for kind in (FORWARD, BACKWARD):
            done = sorted(a.micro_batch for a in actions if a.kind == kind)
            if done != list(range(num_micro_batches)):
                raise ValueError(f"stage {s}: {kind} runs micro-batches {done}, expected 0..{num_micro_batches - 1}")
        if actions[-1].kind != OPTIMIZER_STEP:
            raise ValueError(f"stage {s}: the optimizer step must come last")
        position = {(a.kind, a.micro_batch): j for j, a in enumerate(actions)}
        for i in range(num_micro_batches):
            if position[(FORWARD, i)] > position[(BACKWARD, i)]:
                raise ValueError(f"stage {s}: backward({i}) before forward({i})")
    sent: Dict[Tuple[str, int, int], bool] = {}  # (kind, receiver stage, micro-batch)
    cursor = [0] * num_stages
    while True:
        moved = False
        for s in range(num_stages):
            while cursor[s] < len(lists[s]):
                a = lists[s][cursor[s]]
                if a.kind == RECV_ACT and (SEND_ACT, s, a.micro_batch) not in sent:
                    break
                if a.kind == RECV_GRAD and (SEND_GRAD, s, a.micro_batch) not in sent:
                    break
                if a.kind == SEND_ACT:
                    sent[(SEND_ACT, s + 1, a.micro_batch)] = True
                elif a.kind == SEND_GRAD:
                    sent[(SEND_GRAD, s - 1, a.micro_batch)] = True
                cursor[s] += 1
                moved = True
        if all(cursor[s] == len(lists[s]) for s in range(num_stages)):
            return
        if not moved:
            stuck = {s: str(lists[s][cursor[s]]) for s in range(num_stages) if cursor[s] < len(lists[s])}
            raise ValueError(f"schedule deadlocks: ranks wait at {stuck}")
