"""A simulated step as events (what `planner simulate`, timelines and reports show).

The step itself is planner.pipeline.stepgraph's: the lists compiled into a graph and run with
the plan's durations; this module names each node's time span by the action it stands for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Sequence, Tuple

from planner.pipeline import schedule as sched
from planner.pipeline.actions import Action
from planner.pipeline.stepgraph import Position, StepGraph, Term, Timeline


@dataclass(frozen=True)
class SimEvent:
    rank: int
    kind: str  # an ActionKind's value, "batch ..." for a batch of messages, "reduce", "optimizer_step"
    micro_batch: int
    stage: int
    start: float
    end: float


def simulate(lists: Sequence[Sequence[Action]], value: Mapping[Term, float], position: Position,
             collectives: Sequence[Tuple[Term, Sequence[int]]] = ()) -> Tuple[Timeline, List[SimEvent]]:
    """(timeline, events) of one step: every rank's computes, batches of messages and end-of-step
    actions with their start and end (collectives, which belong to no one rank, are left out)."""
    graph = StepGraph(lists, position, collectives)
    timeline = graph.run(value)
    events = []
    for n, node in enumerate(graph.nodes):
        if node.rank < 0:
            continue
        end = timeline.node_end_s[n]
        start = end - sum(value.get(term, 0.0) for term in node.terms)
        if node.action is not None:
            a = node.action
            events.append(SimEvent(node.rank, a.kind.value, a.micro_batch, a.stage, start, end))
        else:
            events.append(SimEvent(node.rank, node.label, -1, -1, start, end))
    return timeline, events


def unit_time_step(schedule: str, pipeline_ranks: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """The simulated step of a schedule's lists at unit times, messages free: a rank's forward, input
    backward and weight backward take 1 each (a whole backward 2), split evenly over its
    `virtual_stages` stages. Its excess over 3 m is the schedule's bubble in units of one forward."""
    S, v = pipeline_ranks * virtual_stages, virtual_stages
    value: dict = {}
    for g in range(S):
        value.update({("forward", g): 1 / v, ("backward", g): 2 / v, ("backward_input", g): 1 / v,
                      ("backward_weight", g): 1 / v})
    ranks = sched.stage_placement(schedule, S, v)
    timeline, _ = simulate(sched.build_schedule(schedule, S, num_micro_batches, v), value, lambda g, i: ranks[g])
    return timeline.step_s
