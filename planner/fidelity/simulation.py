"""Simulate a plan: its instruction lists (those the runtime executes) run through the step graph
with the durations the plan carries — the planner's own prediction, event by event: per-rank busy
and idle time, the bubble fraction, the iteration and each rank's planned memory."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from planner.pipeline.actions import COMPUTE_KINDS
from planner.pipeline.schedule import ActionKind
from planner.pipeline.simulate import SimEvent
from planner.plan.file import Plan

_COMPUTE = tuple(kind.value for kind in COMPUTE_KINDS)  # the split backward's parts too


@dataclass
class RankSimulation:
    rank: int
    stages: List[int]
    busy_s: float  # forwards and backwards
    idle_s: float
    peak_memory_bytes: float  # the plan's memory of this rank (static + its list's peak)


@dataclass
class Simulation:
    iteration_s: float
    bubble_fraction: float
    ranks: List[RankSimulation]
    events: List[SimEvent] = field(default_factory=list)


def simulate_plan(plan: Plan, step_overhead_s: Optional[float] = None) -> Simulation:
    """The plan's step simulated with its durations, plus the step overhead (the plan's, or
    `step_overhead_s` when given). Equals the plan's predicted_iteration_s for its own overhead."""
    timeline, events = plan.simulate_step()
    total = timeline.step_s + (plan.step_overhead_s if step_overhead_s is None else step_overhead_s)
    ranks = []
    compute = 0.0
    for r, actions in enumerate(plan.instruction_lists()):
        busy = sum(e.end - e.start for e in events if e.rank == r and e.kind in _COMPUTE)
        compute += busy
        stages = sorted({a.stage for a in actions if a.kind is ActionKind.FORWARD})
        memory = plan.stages[stages[0]].memory_bytes.get("device_total", 0.0) if stages else 0.0
        ranks.append(RankSimulation(rank=r, stages=stages, busy_s=busy, idle_s=total - busy,
                                    peak_memory_bytes=float(memory)))
    bubble = 1.0 - compute / (len(ranks) * total) if total > 0 else 0.0
    return Simulation(iteration_s=total, bubble_fraction=bubble, ranks=ranks, events=events)


def format_simulation(sim: Simulation) -> str:
    lines = [f"{'rank':>4}  {'stages':<10} {'busy ms':>9} {'idle ms':>9} {'peak MiB':>9}"]
    for r in sim.ranks:
        lines.append(f"{r.rank:>4}  {','.join(map(str, r.stages)):<10} {r.busy_s * 1e3:>9.3f} {r.idle_s * 1e3:>9.3f} "
                     f"{r.peak_memory_bytes / 2**20:>9.2f}")
    lines.append(f"simulated iteration {sim.iteration_s * 1e3:.3f} ms, bubble {sim.bubble_fraction * 100:.1f}%")
    return "\n".join(lines)
