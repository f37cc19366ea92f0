"""The lists a plan runs, as the cost model sees them: step graphs and held-memory peaks, cached.

A plan's lists depend on its shape alone (schedule, stages, micro-batches, placement, which ranks
share a tied weight), not on the split's costs, so every split of one shape reuses one compiled
graph: the cost model and the solvers evaluate thousands of splits with a few graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

from planner.pipeline import schedule as sched
from planner.pipeline.actions import Action
from planner.pipeline.stepgraph import StepGraph, Term, Timeline, held_peaks


@dataclass(frozen=True)
class StepShape:
    """What fixes a step's lists."""

    schedule: str
    num_stages: int  # S = p v plan stages
    num_micro_batches: int  # m
    virtual_stages: int = 1  # v
    replicas: Tuple[int, ...] = ()  # r_g per stage; () = one device each
    collectives: Tuple[Tuple[Term, Tuple[int, ...]], ...] = ()  # (term, member ranks), in run order

    @property
    def pipeline_ranks(self) -> int:
        """Lists (devices) per data-parallel replica: p, or sum_g r_g with replicated stages."""
        return sum(self.replicas) if self.replicas else self.num_stages // self.virtual_stages

    def rank_of(self, stage: int, micro_batch: int = 0) -> int:
        """The rank running (stage, micro-batch): looping placement g mod p, or a stage's replica."""
        if self.replicas:
            return sum(self.replicas[:stage]) + micro_batch % self.replicas[stage]
        return stage % self.pipeline_ranks


@lru_cache(maxsize=256)
def stage_devices(shape: StepShape) -> Tuple[Tuple[int, ...], ...]:
    """The devices running each stage (one, or a replicated stage's r_g)."""
    return tuple(tuple(sorted({shape.rank_of(g, i) for i in range(shape.num_micro_batches)}))
                 for g in range(shape.num_stages))


@lru_cache(maxsize=256)
def step_lists(shape: StepShape) -> Tuple[Tuple[Action, ...], ...]:
    lists = sched.build_schedule(shape.schedule, shape.num_stages, shape.num_micro_batches, shape.virtual_stages,
                                 stage_replicas=shape.replicas or None)
    return tuple(tuple(actions) for actions in lists)


@lru_cache(maxsize=256)
def step_graph(shape: StepShape) -> StepGraph:
    return StepGraph(step_lists(shape), shape.rank_of, shape.collectives)


@lru_cache(maxsize=256)
def rank_peaks(shape: StepShape) -> Tuple[Tuple[Dict[Term, int], ...], ...]:
    """Per rank, the Pareto-maximal held counts of its list (planner.pipeline.stepgraph.held_peaks)."""
    return tuple(tuple(held_peaks(actions)) for actions in step_lists(shape))


def stage_in_flight(shape: StepShape) -> List[int]:
    """Per stage: the most micro-batches it holds for backward at once on one of its ranks."""
    peaks = rank_peaks(shape)
    return [max((p.get(("live", g), 0) for p in peaks[shape.rank_of(g)]), default=0)
            for g in range(shape.num_stages)]


@lru_cache(maxsize=256)
def _levels(graph: StepGraph) -> Tuple[Tuple[np.ndarray, ...], ...]:
    """The graph's nodes grouped by depth (every predecessor in an earlier group), each group as
    arrays: node ids, predecessors and edge terms (column 0 and padding: the step's start, no term),
    own terms (padding: no term). Index N (nodes) and T (terms) stand for 0."""
    preds, own = graph.predecessors, graph.own_terms
    N, T = len(preds), len(graph.terms)
    depth = [0] * N
    groups: Dict[int, List[int]] = {}
    for n in range(N):
        depth[n] = 1 + max((depth[p] for p, _ in preds[n] if p >= 0), default=-1)
        groups.setdefault(depth[n], []).append(n)
    levels = []
    for d in sorted(groups):
        nodes = groups[d]
        width = 1 + max(len(preds[n]) for n in nodes)
        before, edge = np.full((len(nodes), width), N), np.full((len(nodes), width), T)
        mine = np.full((len(nodes), max(1, max(len(own[n]) for n in nodes))), T)
        for i, n in enumerate(nodes):
            for j, (p, t) in enumerate(preds[n]):
                before[i, j + 1], edge[i, j + 1] = (p if p >= 0 else N), (t if t >= 0 else T)
            mine[i, :len(own[n])] = own[n]
        levels.append((np.array(nodes), before, edge, mine))
    return tuple(levels)


def run_many(graph: StepGraph, values: Sequence[Mapping[Term, float]]) -> List[Timeline]:
    """`graph.run` for several sets of durations at once, vectorised over the sets level by level:
    the same rule in the same floating-point order (the first largest predecessor, as run's strict
    '>' keeps; own terms added one by one), so each Timeline is the one `run` gives, without node
    ends. For searches that simulate many splits of one shape."""
    K, N, terms = len(values), len(graph.predecessors), graph.terms
    if K == 0:
        return []
    val = np.zeros((len(terms) + 1, K))
    for k, value in enumerate(values):
        val[:-1, k] = [float(value.get(term, 0.0)) for term in terms]
    end = np.zeros((N + 1, K))
    via = np.zeros((N, K), dtype=np.int64)
    for nodes, before, edge, mine in _levels(graph):
        candidates = end[before] + val[edge]  # (nodes, predecessors, sets)
        arg = candidates.argmax(axis=1)
        best = np.take_along_axis(candidates, arg[:, None, :], axis=1)[:, 0, :]
        for j in range(mine.shape[1]):
            best = best + val[mine[:, j]]
        end[nodes], via[nodes] = best, arg
    preds = graph.predecessors

    def entered(k: int):
        def from_(n: int) -> Tuple[int, int]:
            column = int(via[n, k])
            return preds[n][column - 1] if column > 0 else (-1, -1)
        return from_

    return [graph.timeline(end[:N, k], entered(k)) for k in range(K)]
