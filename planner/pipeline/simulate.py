"""A simulated step as events (what `planner simulate`, timelines and reports show).

The step itself is planner.pipeline.stepgraph's: the lists compiled into a graph and run with
the plan's durations; this module names each node's time span by the action it stands for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Sequence, Tuple

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
