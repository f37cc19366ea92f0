"""Where every piece of a plan runs: replicas, pipeline ranks and stages.

A plan has S = p·v stages (in model order), p pipeline ranks per data-parallel replica and d
data-parallel replicas of the whole pipeline:

    world size       = d · p
    global rank      = replica · p + pipeline rank, or the device a placement gives it:
                     placement[replica][pipeline rank] (planner.cost.placement; a permutation of the
                     world's ranks, so the launcher's rank r is the placement's device r)
    stage g          runs on pipeline rank  stage_rank[g] = the plan stage's "device" (default g mod p;
                     zb-v: the V, planner.pipeline.zerobubble.v_placement)
    local stage c    of a pipeline rank = its c-th stage in model order (looping placement: g = c · p + rank)

Replicated stages (v = 1 only): stage g may have r_g = "replicas" > 1 pipeline ranks, its lanes:
stage_rank[g] = sum_{h<g} r_h .. stage_rank[g] + r_g - 1, so p = sum_g r_g, and micro-batch i of
stage g runs on pipeline rank stage_rank[g] + (i mod r_g) (lane i mod r_g).

Pure functions of the plan's fields: every rank derives the same topology without talking.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from planner.pipeline import schedule as sched


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Topology:
    num_stages: int  # S = p · v
    pipeline_ranks: int  # p: per data-parallel replica
    virtual_stages: int  # v
    data_parallel: int  # d
    stage_rank: tuple  # stage g -> the (first) pipeline rank running it
    stage_replicas: Optional[tuple] = None  # stage g -> r_g (None: 1 each)
    placement: Optional[tuple] = None  # [replica][pipeline rank] -> global rank (None: replica · p + rank)

    @property
    def world_size(self) -> int:
        return self.pipeline_ranks * self.data_parallel

    @property
    def replicated(self) -> bool:
        return self.stage_replicas is not None and any(r > 1 for r in self.stage_replicas)

    def replicas_of(self, stage: int) -> int:
        return 1 if self.stage_replicas is None else self.stage_replicas[stage]

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica of a global rank."""
        if self.placement is not None:
            return next(r for r, row in enumerate(self.placement) if rank in row)
        return rank // self.pipeline_ranks

    def pipeline_rank_of(self, rank: int) -> int:
        """The pipeline rank of a global rank within its data-parallel replica."""
        if self.placement is not None:
            return self.placement[self.replica_of(rank)].index(rank)
        return rank % self.pipeline_ranks

    def global_rank(self, replica: int, pipeline_rank: int) -> int:
        if self.placement is not None:
            return self.placement[replica][pipeline_rank]
        return replica * self.pipeline_ranks + pipeline_rank

    def ranks_of(self, stage: int) -> List[int]:
        """The pipeline ranks holding a stage (one unless the stage is replicated)."""
        first = self.stage_rank[stage]
        return list(range(first, first + self.replicas_of(stage)))

    def rank_running(self, stage: int, micro_batch: int) -> int:
        """The pipeline rank that runs `micro_batch` through `stage` (round-robin over its lanes)."""
        return self.stage_rank[stage] + micro_batch % self.replicas_of(stage)

    def stages_of(self, pipeline_rank: int) -> List[int]:
        """The stages a pipeline rank runs, in model order."""
        return [g for g in range(self.num_stages) if pipeline_rank in self.ranks_of(g)]

    def lane_of(self, pipeline_rank: int) -> int:
        """Which replica of its stage a pipeline rank is (0 unless the stage is replicated)."""
        return pipeline_rank - self.stage_rank[self.stages_of(pipeline_rank)[0]]

    def micro_batches_of(self, pipeline_rank: int, stage: int, num_micro_batches: int) -> List[int]:
        """The micro-batches a pipeline rank runs through one of its stages."""
        r, lane = self.replicas_of(stage), pipeline_rank - self.stage_rank[stage]
        return [i for i in range(num_micro_batches) if i % r == lane]

    def reporting_rank(self) -> int:
        """The pipeline rank that prints progress: the last one running the last stage (which
        computes the loss; rank p - 1, except under zb-v's V, where it is rank 0)."""
        return self.ranks_of(self.num_stages - 1)[-1]

    def data_parallel_group(self, pipeline_rank: int) -> List[int]:
        """All global ranks holding the same stages as this pipeline rank: its stage's lanes in
        every data-parallel replica. Their gradients are all-reduced before the optimizer step."""
        stages = self.stages_of(pipeline_rank)
        same = [q for q in range(self.pipeline_ranks) if self.stages_of(q) == stages]
        return [self.global_rank(r, q) for r in range(self.data_parallel) for q in same]

    def primary_ranks(self) -> List[int]:
        """One pipeline rank per distinct set of stages (lane 0): whose state stands for the model."""
        return [q for q in range(self.pipeline_ranks) if self.lane_of(q) == 0]


def topology_of(stage_devices: Sequence[Optional[int]], stage_replicas: Sequence[Any], schedule: str,
                num_micro_batches: int, virtual_stages: int = 1, pipeline_ranks: Optional[int] = None,
                data_parallel: int = 1, placement: Optional[Sequence[Sequence[int]]] = None) -> Topology:
    """The topology of a plan's S stages, from its fields: stage_devices[g] is stage g's "device"
    (None: the default), stage_replicas[g] its "replicas", pipeline_ranks the plan's
    pipeline_stages (None: S / v, or the sum of the replicas), placement the plan's (None or
    empty: the launcher's order). TopologyError says what does not fit."""
    topology = _stage_topology(stage_devices, stage_replicas, schedule, num_micro_batches, virtual_stages,
                               pipeline_ranks, data_parallel)
    if not placement:
        return topology
    rows = tuple(tuple(row) for row in placement)
    p, d = topology.pipeline_ranks, topology.data_parallel
    if not is_placement(rows, p, d):
        raise TopologyError(f"the plan's placement {[list(row) for row in rows]} is not {d} replica(s) x {p} "
                            f"pipeline rank(s) using each rank 0..{p * d - 1} once")
    if topology.replicated:
        raise TopologyError("a placement does not combine with replicated stages")
    return dataclasses.replace(topology, placement=None if rows == launcher_order(p, d) else rows)


def is_placement(rows: Sequence[Sequence[int]], pipeline_ranks: int, data_parallel: int) -> bool:
    """Whether `rows` places p pipeline ranks x d replicas: d rows of p, each of 0 .. p d - 1 once
    (global ranks here, a topology's devices in planner.cost.placement)."""
    p, d = pipeline_ranks, data_parallel
    return len(rows) == d and all(len(row) == p for row in rows) and \
        sorted(x for row in rows for x in row) == list(range(p * d))


def launcher_order(pipeline_ranks: int, data_parallel: int) -> Tuple[Tuple[int, ...], ...]:
    """The placement of the launcher's order: replica r's pipeline rank i on r p + i."""
    p = pipeline_ranks
    return tuple(tuple(r * p + i for i in range(p)) for r in range(data_parallel))


def _stage_topology(stage_devices: Sequence[Optional[int]], stage_replicas: Sequence[Any], schedule: str,
                    num_micro_batches: int, virtual_stages: int, pipeline_ranks: Optional[int],
                    data_parallel: int) -> Topology:
    num_stages = len(stage_devices)
    v, d = virtual_stages, data_parallel
    replicas = tuple(stage_replicas)
    for g, r in enumerate(replicas):
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise TopologyError(f"plan stage {g} has replicas {r!r}, expected an integer >= 1; re-run `planner solve`")
    if d < 1:
        raise TopologyError(f"data_parallel must be >= 1 (got {d})")
    if any(r > 1 for r in replicas):
        return _replicated_topology(stage_devices, replicas, schedule, num_micro_batches, v, pipeline_ranks, d)
    p = pipeline_ranks or (num_stages // v if v >= 1 else 0)
    if p < 1 or v < 1 or p * v != num_stages:
        raise TopologyError(f"the plan has {num_stages} stages but pipeline_stages={p} x virtual_stages={v}; "
                            "re-run `planner solve`")
    default = sched.stage_placement(schedule, num_stages, v)
    devices = tuple(default[g] if dev is None else dev for g, dev in enumerate(stage_devices))
    for g, dev in enumerate(devices):
        if not 0 <= dev < p:
            raise TopologyError(f"plan stage {g} is placed on device {dev}, outside 0..{p - 1}")
    for rank in range(p):
        if not any(dev == rank for dev in devices):
            raise TopologyError(f"pipeline rank {rank} runs no stage of the plan")
    return Topology(num_stages=num_stages, pipeline_ranks=p, virtual_stages=v, data_parallel=d,
                    stage_rank=devices)


def _replicated_topology(stage_devices: Sequence[Optional[int]], replicas: tuple, schedule: str,
                         num_micro_batches: int, v: int, pipeline_ranks: Optional[int], d: int) -> Topology:
    if v != 1:
        raise TopologyError("replicated stages need one stage per device (virtual_stages 1); re-run `planner solve`")
    if schedule not in sched.ONE_STAGE_SCHEDULES:
        raise TopologyError(f"replicated stages run with gpipe or 1f1b, not {schedule!r}; re-run `planner solve`")
    m = num_micro_batches
    for g, r in enumerate(replicas):
        if r > m:
            raise TopologyError(f"plan stage {g} has {r} replicas but only {m} micro-batches (a stage needs at "
                                "least as many, or a replica would have nothing to do); use fewer replicas or more "
                                "micro-batches")
    offsets = tuple(sum(replicas[:g]) for g in range(len(replicas)))
    p = sum(replicas)
    for g, dev in enumerate(stage_devices):
        if dev is not None and dev != offsets[g]:
            raise TopologyError(f"plan stage {g} has {replicas[g]} replica(s) on devices from {dev}, "
                                f"but replicated stages take consecutive devices (expected {offsets[g]}); "
                                "re-run `planner solve`")
    planned = pipeline_ranks or p
    if planned != p:
        raise TopologyError(f"the plan's stage replicas add up to {p} devices but pipeline_stages is {planned}; "
                            "re-run `planner solve`")
    return Topology(num_stages=len(replicas), pipeline_ranks=p, virtual_stages=1, data_parallel=d,
                    stage_rank=offsets, stage_replicas=replicas)


def instruction_lists(topology: Topology, schedule: str, num_micro_batches: int) -> List[List[sched.Action]]:
    """Every pipeline rank's instruction list (planner.pipeline.schedule.build_schedule)."""
    return sched.build_schedule(schedule, topology.num_stages, num_micro_batches, topology.virtual_stages,
                                topology.stage_rank, topology.stage_replicas)
