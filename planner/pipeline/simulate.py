"""A discrete-event simulation of the instruction lists: when each action would start and end.

Pure and fast (no processes). Each rank runs its list in order. A forward or backward of chunk g
takes the plan's per-micro-batch time of that stage; a send occupies its sender for the transfer
time (bytes / bandwidth + latency) and its message can be received from then on; a receive waits
until its message has arrived; the optimizer step takes the plan's slowest once-per-step gradient
exchange (all-reduce over data-parallel and stage replicas, tied weights), as the closed form
charges it. The simulated step time is when the last rank finishes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from planner.pipeline import schedule as sched


@dataclass(frozen=True)
class SimEvent:
    rank: int
    kind: str
    micro_batch: int
    chunk: int
    start: float
    end: float


@dataclass
class StageCosts:
    forward_s: float
    backward_s: float
    send_act_s: float  # transfer of this chunk's outputs to the next chunk
    send_grad_s: float  # transfer of gradients of this chunk's inputs to the previous chunk
    optimizer_s: float = 0.0


def simulate(lists: Sequence[List[sched.Action]], costs: Dict[int, StageCosts]) -> Tuple[float, List[SimEvent]]:
    """(step time, events) for one step of the given per-rank lists."""
    clock = [0.0] * len(lists)
    cursor = [0] * len(lists)
    arrived: Dict[Tuple[str, int, int], float] = {}  # (kind, receiving chunk, micro-batch) -> time
    events: List[SimEvent] = []
    while any(cursor[r] < len(lists[r]) for r in range(len(lists))):
        moved = False
        for r, actions in enumerate(lists):
            while cursor[r] < len(actions):
                a = actions[cursor[r]]
                start = clock[r]
                cost = costs[a.chunk] if a.micro_batch >= 0 else None
                if a.kind in (sched.RECV_ACT, sched.RECV_GRAD):
                    key = (sched.SEND_ACT if a.kind == sched.RECV_ACT else sched.SEND_GRAD, a.chunk, a.micro_batch)
                    if key not in arrived:
                        break
                    end = max(start, arrived[key])
                elif a.kind == sched.FORWARD:
                    end = start + cost.forward_s
                elif a.kind == sched.BACKWARD:
                    end = start + cost.backward_s
                elif a.kind == sched.SEND_ACT:
                    end = start + cost.send_act_s
                    arrived[(sched.SEND_ACT, a.chunk + 1, a.micro_batch)] = end
                elif a.kind == sched.SEND_GRAD:
                    end = start + cost.send_grad_s
                    arrived[(sched.SEND_GRAD, a.chunk - 1, a.micro_batch)] = end
                else:  # optimizer step: the slowest chunk's optimizer cost on this rank
                    end = start + max((c.optimizer_s for c in costs.values()), default=0.0)
                events.append(SimEvent(r, a.kind, a.micro_batch, a.chunk, start, end))
                clock[r] = end
                cursor[r] += 1
                moved = True
        if not moved:
            raise ValueError("the instruction lists deadlock")
    return max(clock), events
