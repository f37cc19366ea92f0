"""The lists a plan runs, as the cost model sees them: step graphs and held-memory peaks, cached.

A plan's lists depend on its shape alone (schedule, stages, micro-batches, placement, which ranks
share a tied weight), not on the split's costs, so every split of one shape reuses one compiled
graph: the cost model and the solvers evaluate thousands of splits with a few graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

from planner.pipeline import schedule as sched
from planner.pipeline.actions import Action
from planner.pipeline.stepgraph import StepGraph, Term, held_peaks


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
        """The rank running (stage, micro-batch): the schedule's placement (looping g mod p; zb-v's V),
        or a stage's replica."""
        if self.replicas:
            return sum(self.replicas[:stage]) + micro_batch % self.replicas[stage]
        return sched.stage_placement(self.schedule, self.num_stages, self.virtual_stages)[stage]


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
