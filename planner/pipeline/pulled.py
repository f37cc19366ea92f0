"""Messages for replicated stages' 1F1B lists: each input received when the rank needs it, each output
sent just before its receiver asks for it.

A replicated stage's replicas exchange messages with several ranks of each neighbour, so a rank's
batches involve several peers; under NCCL's rules (planner.pipeline.stepgraph: a rank's operations
complete in the order posted, a send only together with its receive) a batch that mixes a peer
ready now with one ready only later holds the rank until the later one. planner.pipeline.messages
sends every output right after the compute that makes it and receives it at the receiver's first
point after that: a narrow stage feeding r replicas then waits, at its next batch, for the replica
that asks for that output only a round of r micro-batches later (replicas [1, 3], m = 12, costs
1:2 and 3:6 per micro-batch: 47 against 43 for GPipe; 15 of 60 random replicated pipelines slower
under 1F1B than under GPipe, by up to 1.18x).

The rule here, on a replay of the compute orders with forward w_g and backward 2 w_g (w_g = r_g:
each replica of a stage replicated r_g times is that much heavier) and free messages; a rank's
gap k lies before its compute k (the last one after its last compute), arriving when compute
k - 1 ends and leaving when compute k starts:

1. Receives. A rank's gaps before computes that need another rank's value are visited in order;
   a gap not yet served posts the receive its compute needs together with every later input of
   the rank already made by the time the gap leaves (one batch, one wait, where a receive per
   compute would wait once each). Its leaving time is the message's meeting time.
2. Sends. The sender posts an output in its last gap (at or after the compute making it) that it
   reaches by the meeting time, so that it neither waits for a receiver that asks later nor
   delays one that asks now. An output held past a compute is memory: held_peaks counts it.
3. Order within a gap: the sends meeting before the gap leaves (a batch of sends only), then the
   receives with the sends meeting as the gap leaves (one batch), then the sends meeting later.

In the replay every batch then completes when it is posted, so the lists run as the replay does
and cannot deadlock (planner.pipeline.schedule checks each result all the same, and check_schedule
every plan's lists; tests/pipeline/test_pulled.py on every tuple of up to three stages of up to four
replicas). On the 60 random pipelines of
tests/runtime/test_replicated.py none is slower than GPipe, and replicas [1, 3], m = 12 simulate
43 (BENCHMARKS.md, "Replicated 1F1B's messages").
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Sequence, Tuple

from planner.pipeline.actions import Action, ActionKind
from planner.pipeline.messages import Position, message_ends, needed_message, produced_message, replay

_TIE = 1e-9  # the replay's times are sums of small integers: equal times compare equal within this
_BEFORE, _AT, _AFTER = 0, 1, 2  # a send's meeting time against its gap's leaving time (rule 3)


def place_pulled_messages(orders: Sequence[Sequence[Action]], num_stages: int, position: Position,
                          weights: Sequence[float]) -> List[List[Action]]:
    """Complete lists (compute, numbered batches, optimizer step) for the compute orders of ranks
    running one stage each, by the module's rule; `weights[g]`: stage g's relative cost in the replay."""
    times = replay(orders, num_stages, weights)
    arrive = [[0.0] + [end for _, end in rank] for rank in times]
    leave = [[start for start, _ in rank] + [rank[-1][1] if rank else 0.0] for rank in times]
    made_at = {produced_message(a, num_stages): times[r][k][1]
               for r, order in enumerate(orders) for k, a in enumerate(order)}
    # gap -> [(meeting time, rule-3 group, sequence, communication action)]
    gaps: List[Dict[int, List[Tuple[float, int, int, Action]]]] = [dict() for _ in orders]
    meets: Dict[Tuple[str, int, int], float] = {}
    sequence = 0
    for r, order in enumerate(orders):
        remote = _remote_inputs(order, num_stages, position, r)
        served = set()
        for n, (k, message) in enumerate(remote):
            if message in served:
                continue
            ready = [later for _, later in remote[n + 1:]
                     if later not in served and made_at[later] <= leave[r][k] + _TIE]
            for taken in [message] + ready:
                served.add(taken)
                meets[taken] = leave[r][k]
                gaps[r].setdefault(k, []).append((leave[r][k], _AT, sequence, message_ends(taken)[1]))
                sequence += 1
    for r, order in enumerate(orders):
        for k, a in enumerate(order):
            message = produced_message(a, num_stages)
            if message is None or position(message_ends(message)[3], a.micro_batch) == r:
                continue
            meet = meets[message]
            gap = max(k + 1, bisect.bisect_right(arrive[r], meet + _TIE) - 1)
            side = _BEFORE if meet < leave[r][gap] - _TIE else _AT if meet <= leave[r][gap] + _TIE else _AFTER
            gaps[r].setdefault(gap, []).append((meet, side, sequence, message_ends(message)[0]))
            sequence += 1
    lists: List[List[Action]] = []
    batch = 0
    for r, order in enumerate(orders):
        actions: List[Action] = []
        for k in range(len(order) + 1):
            posted = gaps[r].get(k, [])
            for side in (_BEFORE, _AT, _AFTER):
                group = sorted((meet, n, comm) for meet, s, n, comm in posted if s == side)
                if group:
                    actions += [Action(comm.kind, comm.micro_batch, comm.stage, batch=batch) for _, _, comm in group]
                    batch += 1
            if k < len(order):
                actions.append(order[k])
        lists.append(actions + [Action(ActionKind.OPTIMIZER_STEP)])
    return lists


def _remote_inputs(order: Sequence[Action], num_stages: int, position: Position,
                   rank: int) -> List[Tuple[int, Tuple[str, int, int]]]:
    """(k, message) of each compute k of the rank's order that needs a value another rank makes."""
    out = []
    for k, action in enumerate(order):
        message = needed_message(action, num_stages)
        if message is not None and position(message_ends(message)[2], action.micro_batch) != rank:
            out.append((k, message))
    return out
