"""Does a plan keep its promises? Simulate it, and check it against a run's report.

- `simulate_plan`: discrete-event simulation of the plan's instruction lists (the same lists the
  runtime executes) with the plan's per-stage costs: per-rank busy and idle time, bubble fraction,
  iteration time and peak memory per rank.
- `check_report`: predicted vs measured per rank and overall, with relative errors, and the
  host's speed during the run against the profile's (planner.profile.hostspeed).

Correcting the profile from runs' reports is `planner.fidelity.calibrate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from planner.pipeline import schedule as sched
from planner.profile.hostspeed import host_speed_lines
from planner.pipeline.simulate import SimEvent, costs_from_plan, simulate
from planner.pipeline.topology import instruction_lists


@dataclass
class RankSimulation:
    rank: int
    chunks: List[int]
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


def _lists(plan: Dict[str, Any]) -> List[List[sched.Action]]:
    return instruction_lists(plan)


def simulate_plan(plan: Dict[str, Any], step_overhead_s: Optional[float] = None) -> Simulation:
    """The plan's schedule simulated event by event; the time charged once per step (the plan's
    `per_step_s`: step overhead and optimizer step, or `step_overhead_s` when given) is added."""
    lists = _lists(plan)
    costs = costs_from_plan(plan)
    total, events = simulate(lists, costs)
    total += float(plan.get("per_step_s", 0.0)) if step_overhead_s is None else step_overhead_s
    ranks = []
    compute = 0.0
    for r, actions in enumerate(lists):
        mine = [e for e in events if e.rank == r]
        busy = sum(e.end - e.start for e in mine if e.kind not in (sched.RECV_ACT, sched.RECV_GRAD))
        compute += sum(e.end - e.start for e in mine if e.kind in (sched.FORWARD, sched.BACKWARD))
        chunks = sorted({a.chunk for a in actions if a.kind == sched.FORWARD})
        ranks.append(RankSimulation(rank=r, chunks=chunks, busy_s=busy, idle_s=total - busy,
                                    peak_memory_bytes=_peak_memory(plan, actions, chunks)))
    bubble = 1.0 - compute / (len(lists) * total) if total > 0 else 0.0
    closed = plan.get("predicted_iteration_s") if plan["schedule"] in ("gpipe", "1f1b") else None
    return Simulation(iteration_s=total, bubble_fraction=bubble, ranks=ranks, events=events, closed_form_s=closed)


def _peak_memory(plan: Dict[str, Any], actions: List[sched.Action], chunks: List[int]) -> float:
    """Static memory of the rank's stages plus the most activations held at once, walking its list."""
    static, per_micro_batch = 0.0, {}
    for g in chunks:
        mem = plan["stages"][g].get("memory_bytes", {})
        static += float(mem.get("params", 0)) + float(mem.get("grads", 0)) + float(mem.get("optimizer", 0))
        held = max(int(plan["stages"][g].get("in_flight", 1) or 1), 1)
        per_micro_batch[g] = float(mem.get("activations", 0)) / held
    live = peak = 0.0
    for a in actions:
        if a.kind == sched.FORWARD:
            live += per_micro_batch[a.chunk]
            peak = max(peak, live)
        elif a.kind == sched.BACKWARD:
            live -= per_micro_batch[a.chunk]
    return static + peak


def format_simulation(sim: Simulation) -> str:
    lines = [f"{'rank':>4}  {'stages':<10} {'busy ms':>9} {'idle ms':>9} {'peak MiB':>9}"]
    for r in sim.ranks:
        lines.append(f"{r.rank:>4}  {','.join(map(str, r.chunks)):<10} {r.busy_s * 1e3:>9.3f} {r.idle_s * 1e3:>9.3f} "
                     f"{r.peak_memory_bytes / 2**20:>9.2f}")
    lines.append(f"simulated iteration {sim.iteration_s * 1e3:.3f} ms, bubble {sim.bubble_fraction * 100:.1f}%")
    if sim.closed_form_s is not None:
        diff = (sim.iteration_s - sim.closed_form_s) / sim.closed_form_s * 100 if sim.closed_form_s else 0.0
        lines.append(f"solver's closed form {sim.closed_form_s * 1e3:.3f} ms ({diff:+.2f}% from the simulation)")
    return "\n".join(lines)


# --- predicted vs measured -------------------------------------------------------------------
def _rel(measured: float, predicted: float) -> Optional[float]:
    return (measured - predicted) / predicted if predicted else None


def check_report(plan: Dict[str, Any], report: Dict[str, Any]) -> Dict[str, Any]:
    if report.get("model") != plan.get("model"):
        raise ValueError("the report is of a different model than the plan; pass the plan the run executed")
    ranks = []
    for r in report["stages"]:
        if r.get("replica", 0) != 0:
            continue
        me, pr = r["measured"], r["predicted"]
        ranks.append({"rank": r["rank"], "chunks": r.get("chunks", [r["rank"]]),
                      "forward": (me["forward_s"], pr["forward_s"], _rel(me["forward_s"], pr["forward_s"])),
                      "backward": (me["backward_s"], pr["backward_s"], _rel(me["backward_s"], pr["backward_s"])),
                      "waiting_s": me.get("recv_wait_s", 0.0) + me.get("send_wait_s", 0.0)})
    measured, predicted = report["measured_iteration_s"], plan["predicted_iteration_s"]
    return {"ranks": ranks, "iteration": (measured, predicted, _rel(measured, predicted)),
            "host_slowdown": report.get("host_slowdown")}


def format_check(result: Dict[str, Any]) -> str:
    def cell(triple) -> str:
        me, pr, rel = triple
        return f"{me * 1e3:9.2f} {pr * 1e3:9.2f} {'' if rel is None else f'{rel * 100:+6.1f}%':>7}"

    lines = [f"{'rank':>4}  {'forward ms: measured predicted error':<36}  {'backward ms: measured predicted error':<37}",
             ]
    for r in result["ranks"]:
        lines.append(f"{r['rank']:>4}  {cell(r['forward']):<36}  {cell(r['backward']):<37}")
    me, pr, rel = result["iteration"]
    lines.append(f"iteration: measured {me * 1e3:.2f} ms, predicted {pr * 1e3:.2f} ms, error "
                 f"{'n/a' if rel is None else f'{rel * 100:+.1f}%'}")
    lines += host_speed_lines(result.get("host_slowdown"), pr, me)
    return "\n".join(lines)
