"""Slow links emulated on one machine, so that a plan for devices in several sites can be run and
its prediction checked here (issue 22).

A plan made with a cluster whose link says `"emulate": true` (planner.cost.cluster) lists the stage
boundaries whose messages cross that link (`emulated_boundaries`). The runtime lets each such
message cross loopback as usual and then holds both its sender and its receiver for the message's
planned transfer time (the plan's `step_durations`: latency + bytes / bandwidth of that boundary),
after the batch that carried it completed: the cost model's rule for a transfer (done = both ends
posted + transfer) with the transfer itself emulated. A batch holding several such messages waits
for the longest one (the model's messages in a batch cross together). Loopback's own time is not
subtracted: on a link a hundred times slower than loopback it adds about 1 %.

A plan placed on a leveled topology (planner.cost.placement) whose data-parallel exchange crosses
an emulated level says how long (`emulated_exchange_s`, per pipeline rank): the share of the
planned exchange spent on that link. Each rank holds that long after its own exchange (which runs
over loopback at the speed the in-site links were planned at).
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, Optional, Tuple

from planner.pipeline.actions import Action, ActionKind

Crossing = Tuple[str, int]  # ("act" | "grad", boundary j between stages j and j + 1)


def link_delays(plan: Any) -> Dict[Crossing, float]:
    """Seconds each message over an emulated boundary is held: the plan's transfer times."""
    durations = plan.step_durations or {}
    act, grad = durations.get("act") or [], durations.get("grad") or []
    delays: Dict[Crossing, float] = {}
    for j in plan.emulated_boundaries:
        delays[("act", j)] = float(act[j]) if j < len(act) else 0.0
        delays[("grad", j)] = float(grad[j]) if j < len(grad) else 0.0
    return delays


def crossing(action: Action) -> Optional[Crossing]:
    """The boundary a communication action's message crosses, and its direction."""
    g = action.stage
    return {ActionKind.SEND_ACT: ("act", g), ActionKind.RECV_ACT: ("act", g - 1),
            ActionKind.SEND_GRAD: ("grad", g - 1), ActionKind.RECV_GRAD: ("grad", g)}.get(action.kind)


def transfer_delay(actions: Iterable[Action], delays: Dict[Crossing, float]) -> float:
    """The longest emulated transfer among a batch's messages (0 when none crosses a slow link)."""
    if not delays:
        return 0.0
    return max((delays.get(crossing(a), 0.0) for a in actions), default=0.0)


def hold(actions: Iterable[Action], delays: Dict[Crossing, float]) -> float:
    """Sleep for the longest emulated transfer among a completed batch's messages; the seconds held
    (a batch of sends only is held when it is waited for: runtime.outbox)."""
    longest = transfer_delay(actions, delays)
    if longest > 0:
        time.sleep(longest)
    return longest


def exchange_delay(plan: Any, pipeline_rank: int) -> float:
    """Seconds this pipeline rank holds after its data-parallel exchange (0: none emulated)."""
    held = plan.emulated_exchange_s or []
    return float(held[pipeline_rank]) if pipeline_rank < len(held) else 0.0


def hold_exchange(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)
