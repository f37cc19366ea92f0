"""A discrete-event simulation of the instruction lists: when each action would start and end.

Pure and fast (no processes). Each rank runs its list in order. A forward or backward of stage g
takes the plan's per-micro-batch time of that stage; a send occupies its sender for the transfer
time (bytes / bandwidth + latency) and its message can be received from then on; a receive waits
until its message has arrived; the optimizer step takes the plan's slowest once-per-step gradient
exchange (all-reduce over data-parallel and stage replicas, tied weights), as the closed form
charges it. The simulated step time is when the last rank finishes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from planner.pipeline.schedule import Action, ActionKind


@dataclass(frozen=True)
class SimEvent:
    rank: int
    kind: ActionKind
    micro_batch: int
    stage: int
    start: float
    end: float


@dataclass
class StageCosts:
    """One stage's times per micro-batch (and its optimizer step's), as the plan predicts them."""

    forward_s: float
    backward_s: float
    send_act_s: float  # transfer of this stage's outputs to the next stage
    send_grad_s: float  # transfer of gradients of this stage's inputs to the previous stage
    optimizer_s: float = 0.0


# What a send delivers: (the matching receive's kind, offset of the receiving stage)
_DELIVERS = {ActionKind.SEND_ACT: (ActionKind.RECV_ACT, +1), ActionKind.SEND_GRAD: (ActionKind.RECV_GRAD, -1)}


def _duration(a: Action, costs: Dict[int, StageCosts]) -> float:
    """How long a forward, backward, send or optimizer step keeps its rank busy."""
    if a.kind is ActionKind.OPTIMIZER_STEP:  # the slowest stage's once-per-step exchange
        return max((c.optimizer_s for c in costs.values()), default=0.0)
    cost = costs[a.stage]
    return {ActionKind.FORWARD: cost.forward_s, ActionKind.BACKWARD: cost.backward_s,
            ActionKind.SEND_ACT: cost.send_act_s, ActionKind.SEND_GRAD: cost.send_grad_s}[a.kind]


def simulate(lists: Sequence[List[Action]], costs: Dict[int, StageCosts]) -> Tuple[float, List[SimEvent]]:
    """(step time, events) for one step of the given per-rank lists."""
    clock = [0.0] * len(lists)
    cursor = [0] * len(lists)
    arrived: Dict[Tuple[ActionKind, int, int], float] = {}  # (receive kind, receiving stage, micro-batch) -> time
    events: List[SimEvent] = []
    while any(cursor[r] < len(lists[r]) for r in range(len(lists))):
        moved = False
        for r, actions in enumerate(lists):
            while cursor[r] < len(actions):
                a = actions[cursor[r]]
                start = clock[r]
                if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                    key = (a.kind, a.stage, a.micro_batch)
                    if key not in arrived:
                        break
                    end = max(start, arrived[key])
                else:
                    end = start + _duration(a, costs)
                    if a.kind in _DELIVERS:
                        receive, step = _DELIVERS[a.kind]
                        arrived[(receive, a.stage + step, a.micro_batch)] = end
                events.append(SimEvent(r, a.kind, a.micro_batch, a.stage, start, end))
                clock[r] = end
                cursor[r] += 1
                moved = True
        if not moved:
            raise ValueError("the instruction lists deadlock")
    return max(clock), events
