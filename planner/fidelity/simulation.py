"""Simulate a plan: its instruction lists (those the runtime executes) run through the step graph
with the durations the plan carries — the planner's own prediction, event by event: per-rank busy
and idle time, the bubble fraction, the iteration and each rank's planned memory."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from planner.pipeline.actions import COMPUTE_KINDS
from planner.pipeline.schedule import ActionKind
from planner.pipeline.simulate import SimEvent, simulate
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


def replay_s(plan: Plan, report: Dict[str, Any]) -> float:
    """The plan's lists simulated again with each rank's compute at the speed its run measured: the
    forward terms of its stages scaled by its measured / predicted forward time, the backward terms
    (a split backward's input and weight parts too) by its backward's, its optimizer step the measured
    one where the report has it; messages, links and the step overhead the plan's. The iteration it
    gives minus the measured one is what the plan's lists and message costs miss of the run (waits,
    per-action work the clock does not see, jitter), the host's compute speed taken out: a shared CPU
    host moves that speed by tens of percent between runs, more than the structure's error."""
    value, collectives = plan.step_terms()
    for r in report.get("stages", []):
        if r.get("replica", 0) != 0:
            continue
        me, pr = r["measured"], r["predicted"]
        forward = me["forward_s"] / pr["forward_s"] if pr["forward_s"] > 0 else 1.0
        backward = me["backward_s"] / pr["backward_s"] if pr["backward_s"] > 0 else 1.0
        for g in r.get("chunks", [r["rank"]]):
            for kind, scale in (("forward", forward), ("backward", backward), ("backward_input", backward),
                                ("backward_weight", backward)):
                if (kind, g) in value:
                    value[(kind, g)] *= scale
        rank = r.get("stage", r["rank"])  # its pipeline rank
        if me.get("optimizer_s") is not None and ("step", rank) in value:
            value[("step", rank)] = float(me["optimizer_s"])
    timeline, _ = simulate(plan.instruction_lists(), value, plan.topology().rank_running, collectives)
    return timeline.step_s + plan.step_overhead_s


def format_simulation(sim: Simulation) -> str:
    lines = [f"{'rank':>4}  {'stages':<10} {'busy ms':>9} {'idle ms':>9} {'peak MiB':>9}"]
    for r in sim.ranks:
        lines.append(f"{r.rank:>4}  {','.join(map(str, r.stages)):<10} {r.busy_s * 1e3:>9.3f} {r.idle_s * 1e3:>9.3f} "
                     f"{r.peak_memory_bytes / 2**20:>9.2f}")
    lines.append(f"simulated iteration {sim.iteration_s * 1e3:.3f} ms, bubble {sim.bubble_fraction * 100:.1f}%")
    return "\n".join(lines)
