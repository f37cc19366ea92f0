"""Simulate a plan: the discrete-event simulation of its instruction lists (the lists the runtime
executes) with the plan's per-stage costs: per-rank busy and idle time, bubble fraction, iteration
time and peak memory per rank, beside the solver's closed form."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from planner.pipeline.schedule import ONE_STAGE_SCHEDULES, Action, ActionKind
from planner.pipeline.simulate import SimEvent, simulate
from planner.plan.file import Plan


@dataclass
class RankSimulation:
    rank: int
    stages: List[int]
    busy_s: float
    idle_s: float
    peak_memory_bytes: float


@dataclass
class Simulation:
    iteration_s: float
    bubble_fraction: float
    ranks: List[RankSimulation]
    events: List[SimEvent] = field(default_factory=list)
    closed_form_s: Optional[float] = None  # the solver's formula, where the plan carries it


def simulate_plan(plan: Plan, step_overhead_s: Optional[float] = None) -> Simulation:
    """The plan's schedule simulated event by event; the time charged once per step (the plan's
    `per_step_s`: step overhead and optimizer step, or `step_overhead_s` when given) is added."""
    lists = plan.instruction_lists()
    total, events = simulate(lists, plan.stage_costs())
    total += plan.per_step_s if step_overhead_s is None else step_overhead_s
    ranks = []
    compute = 0.0
    for r, actions in enumerate(lists):
        mine = [e for e in events if e.rank == r]
        busy = sum(e.end - e.start for e in mine if e.kind not in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD))
        compute += sum(e.end - e.start for e in mine if e.kind in (ActionKind.FORWARD, ActionKind.BACKWARD))
        stages = sorted({a.stage for a in actions if a.kind is ActionKind.FORWARD})
        ranks.append(RankSimulation(rank=r, stages=stages, busy_s=busy, idle_s=total - busy,
                                    peak_memory_bytes=_peak_memory(plan, actions, stages)))
    bubble = 1.0 - compute / (len(lists) * total) if total > 0 else 0.0
    closed = plan.predicted_iteration_s if plan.schedule in ONE_STAGE_SCHEDULES else None
    return Simulation(iteration_s=total, bubble_fraction=bubble, ranks=ranks, events=events, closed_form_s=closed)


def _peak_memory(plan: Plan, actions: List[Action], stages: List[int]) -> float:
    """Static memory of the rank's stages plus the most activations held at once, walking its list."""
    static, per_micro_batch = 0.0, {}
    for g in stages:
        mem = plan.stages[g].memory_bytes
        static += float(mem.get("params", 0)) + float(mem.get("grads", 0)) + float(mem.get("optimizer", 0))
        held = max(plan.stages[g].in_flight, 1)
        per_micro_batch[g] = float(mem.get("activations", 0)) / held
    live = peak = 0.0
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            live += per_micro_batch[a.stage]
            peak = max(peak, live)
        elif a.kind is ActionKind.BACKWARD:
            live -= per_micro_batch[a.stage]
    return static + peak


def format_simulation(sim: Simulation) -> str:
    lines = [f"{'rank':>4}  {'stages':<10} {'busy ms':>9} {'idle ms':>9} {'peak MiB':>9}"]
    for r in sim.ranks:
        lines.append(f"{r.rank:>4}  {','.join(map(str, r.stages)):<10} {r.busy_s * 1e3:>9.3f} {r.idle_s * 1e3:>9.3f} "
                     f"{r.peak_memory_bytes / 2**20:>9.2f}")
    lines.append(f"simulated iteration {sim.iteration_s * 1e3:.3f} ms, bubble {sim.bubble_fraction * 100:.1f}%")
    if sim.closed_form_s is not None:
        diff = (sim.iteration_s - sim.closed_form_s) / sim.closed_form_s * 100 if sim.closed_form_s else 0.0
        lines.append(f"solver's closed form {sim.closed_form_s * 1e3:.3f} ms ({diff:+.2f}% from the simulation)")
    return "\n".join(lines)
