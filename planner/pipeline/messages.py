"""Where communication goes in the lists: each rank's compute order in, complete lists out.

Schedules decide the order of each rank's forwards and backwards; this module adds the messages,
one rule for every schedule. A message carries a stage's outputs to the next stage (activations)
or the gradients of its inputs back (gradients). Stages on the same rank hand values over in
memory: no message.

The lists must be deadlock-free under the runtime's semantics (NCCL's, used on gloo too): a rank
posts each batch of adjacent communication actions together and waits for all of them (a batch of
sends only, before its next batch: planner.pipeline.stepgraph), a send is done only when its
receive is posted, a rank's operations complete in the order posted, and a pair of ranks matches
messages in the order posted.
Placement: replay the compute orders with forward w_g and backward 2 w_g time units for stage g and
free messages (w_g = 1, or r_g for a stage replicated on r_g ranks: a stage is replicated because it
is that much heavier, so each of its ranks takes r_g times as long per micro-batch); a message produced at time t is sent in a batch right after the compute producing it
and received in the receiver's first batch point at or after t (a point lies after each compute,
and before a compute the rank had to wait for). Both ends of a message are then posted at the
same moment of that replay, so no batch waits for a later one of another rank. `check_schedule`
proves each result; if one ever failed, lockstep rounds (each rank at most one compute per round,
round r's batch = the messages produced in round r) are used instead, deadlock-free by induction
over rounds.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from planner.pipeline.actions import BACKWARD_KINDS, Action, ActionKind

Position = Callable[[int, int], int]  # (stage, micro-batch) -> the pipeline rank running it

_REPLAY_COST = {ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 2.0, ActionKind.BACKWARD_INPUT: 1.0,
                ActionKind.BACKWARD_WEIGHT: 1.0}
_BACKWARDS = BACKWARD_KINDS  # those that need and send gradients


def needed_message(action: Action, num_stages: int) -> Optional[Tuple[str, int, int]]:
    """The message a compute action consumes: ('act', g - 1, i) for a forward of stage g > 0,
    ('grad', g, i) for a backward (or input backward) of stage g < S - 1; a weight backward needs
    nothing from another stage. Boundary g lies between stages g and g + 1."""
    if action.kind == ActionKind.FORWARD and action.stage > 0:
        return ("act", action.stage - 1, action.micro_batch)
    if action.kind in _BACKWARDS and action.stage < num_stages - 1:
        return ("grad", action.stage, action.micro_batch)
    return None


def produced_message(action: Action, num_stages: int) -> Optional[Tuple[str, int, int]]:
    if action.kind == ActionKind.FORWARD and action.stage < num_stages - 1:
        return ("act", action.stage, action.micro_batch)
    if action.kind in _BACKWARDS and action.stage > 0:
        return ("grad", action.stage - 1, action.micro_batch)
    return None


def message_ends(message: Tuple[str, int, int]) -> Tuple[Action, Action, int, int]:
    """(send action, receive action, sending stage, receiving stage) of a message."""
    kind, boundary, i = message
    if kind == "act":
        return (Action(ActionKind.SEND_ACT, i, boundary), Action(ActionKind.RECV_ACT, i, boundary + 1),
                boundary, boundary + 1)
    return (Action(ActionKind.SEND_GRAD, i, boundary + 1), Action(ActionKind.RECV_GRAD, i, boundary),
            boundary + 1, boundary)


def replay(orders: Sequence[Sequence[Action]], num_stages: int,
           weights: Optional[Sequence[float]] = None) -> List[List[Tuple[float, float]]]:
    """(start, end) of every compute in a replay with free messages, forward w_g, backward 2 w_g: the
    earliest start runs next (the lower rank first among equals). Each rank waits in the heap once its
    next compute's input is made (a start, fixed from then on), or for that input (`waiting`)."""
    ranks = len(orders)
    cursor, clock = [0] * ranks, [0.0] * ranks
    ready: Dict[Tuple[str, int, int], float] = {}
    waiting: Dict[Tuple[str, int, int], int] = {}  # message -> the rank whose next compute needs it
    heap: List[Tuple[float, int]] = []
    times: List[List[Tuple[float, float]]] = [[] for _ in range(ranks)]

    def next_of(r: int) -> None:
        if cursor[r] == len(orders[r]):
            return
        need = needed_message(orders[r][cursor[r]], num_stages)
        if need is not None and need not in ready:
            waiting[need] = r
        else:
            heapq.heappush(heap, (max(clock[r], ready[need] if need is not None else 0.0), r))

    for r in range(ranks):
        next_of(r)
    while heap:
        start, r = heapq.heappop(heap)
        action = orders[r][cursor[r]]
        end = start + _REPLAY_COST[action.kind] * (weights[action.stage] if weights is not None else 1.0)
        times[r].append((start, end))
        clock[r], cursor[r] = end, cursor[r] + 1
        made = produced_message(action, num_stages)
        if made is not None:
            ready[made] = end
            if made in waiting:
                next_of(waiting.pop(made))
        next_of(r)
    if any(cursor[r] < len(orders[r]) for r in range(ranks)):
        raise ValueError("the compute orders cannot finish: a rank waits for a value that is never computed")
    return times


def place_messages(orders: Sequence[Sequence[Action]], num_stages: int, position: Position,
                   lockstep: bool = False, weights: Optional[Sequence[float]] = None,
                   wait_for_receiver: bool = False) -> List[List[Action]]:
    """Complete lists (compute, numbered communication batches, optimizer step) for compute orders;
    `weights[g]`: stage g's relative cost in the replay (default 1 each). `wait_for_receiver`: a
    message whose receiver, busy in the replay, posts its receive later than the value is made is
    sent at the sender's first point from that moment on (the receiver then waits for the sender's
    point, not the sender for the receiver's compute)."""
    ranks = len(orders)
    times = replay(orders, num_stages, weights) if not lockstep else _lockstep_times(orders, num_stages)
    # batch points: (k, 0) before compute k, (k, 1) after it; each holds communication actions
    points: List[Dict[Tuple[int, int], List[Action]]] = [dict() for _ in range(ranks)]

    ends = [[end for _, end in rank_times] for rank_times in times]  # nondecreasing along each rank

    def receive_point(r: int, t: float) -> Tuple[int, int]:
        """The rank's first point at or after t: before the first compute ending at or after t if it
        starts then or later, else after it."""
        k = bisect.bisect_left(ends[r], t)
        if k == len(ends[r]):
            raise ValueError(f"rank {r} receives a message after its last compute")
        return (k, 0) if times[r][k][0] >= t else (k, 1)

    def point_time(r: int, point: Tuple[int, int]) -> float:
        k, side = point
        return times[r][k][side]

    for r, order in enumerate(orders):
        for k, action in enumerate(order):
            made = produced_message(action, num_stages)
            if made is None:
                continue
            send, receive, _, to_stage = message_ends(made)
            dst = position(to_stage, action.micro_batch)
            if dst == r:
                continue  # handed over in memory
            at = receive_point(dst, times[r][k][1])
            # a busy receiver (a replicated stage's rank) posts later than the value is made: the
            # sender posts at its first point from then on, so it does not stand waiting for it
            posted, sent = point_time(dst, at), (k, 1)
            if wait_for_receiver and posted > times[r][k][1]:
                sent = receive_point(r, posted) if posted <= times[r][-1][1] else (len(times[r]) - 1, 1)
            points[r].setdefault(sent, []).append(send)
            points[dst].setdefault(at, []).append(receive)
    lists: List[List[Action]] = []
    batch = 0
    for r, order in enumerate(orders):
        actions: List[Action] = []
        for k, action in enumerate(order):
            for side in (0, 1):
                if side == 1:
                    actions.append(action)
                for comm in points[r].get((k, side), []):
                    actions.append(Action(comm.kind, comm.micro_batch, comm.stage, batch=batch))
                if points[r].get((k, side)):
                    batch += 1
        lists.append(actions + [Action(ActionKind.OPTIMIZER_STEP)])
    return lists


def _lockstep_times(orders: Sequence[Sequence[Action]], num_stages: int) -> List[List[Tuple[float, float]]]:
    """Rounds: every rank runs its next compute if its input was produced in an earlier round."""
    ranks = len(orders)
    cursor = [0] * ranks
    made_in: Dict[Tuple[str, int, int], int] = {}
    times: List[List[Tuple[float, float]]] = [[] for _ in range(ranks)]
    round_ = 0
    while any(cursor[r] < len(orders[r]) for r in range(ranks)):
        produced = []
        for r in range(ranks):
            if cursor[r] == len(orders[r]):
                continue
            action = orders[r][cursor[r]]
            need = needed_message(action, num_stages)
            if need is not None and made_in.get(need, round_) >= round_:
                continue
            times[r].append((float(round_), round_ + 0.5))
            cursor[r] += 1
            made = produced_message(action, num_stages)
            if made is not None:
                produced.append(made)
        if not any(times[r] and times[r][-1][0] == round_ for r in range(ranks)):
            raise ValueError("the compute orders cannot finish: a rank waits for a value that is never computed")
        for made in produced:
            made_in[made] = round_
        round_ += 1
    return times
