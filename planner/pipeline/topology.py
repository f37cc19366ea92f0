"""Where every piece of a plan runs: ranks, replicas, pipeline positions and model chunks.

A plan has P = p·v model chunks ("stages" in the plan file, in model order), p pipeline
positions (devices per data-parallel replica) and d data-parallel replicas of the whole pipeline:

    world size      = d · p
    rank            = replica · p + position
    chunk g         runs on position  device(g) = plan stage's "device" (default g mod p)
    local chunk c   of a position = its c-th chunk in model order (looping placement: g = c · p + position)

Replicated stages (v = 1 only): plan stage g may have r_g = "replicas" > 1 devices. Its devices
are the positions device(g) = sum_{h<g} r_h .. device(g) + r_g - 1, so p = sum_g r_g, and
micro-batch i of stage g runs on position device(g) + (i mod r_g) ("lane" i mod r_g).

Pure functions of the plan: every rank derives the same topology without talking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from planner.pipeline import schedule as sched


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Topology:
    num_chunks: int  # P = p · v
    pipeline_ranks: int  # p: positions per data-parallel replica
    virtual_stages: int  # v
    data_parallel: int  # d
    chunk_device: tuple  # chunk g -> its first position
    chunk_replicas: Optional[tuple] = None  # chunk g -> r_g (None: 1 each)

    @property
    def world_size(self) -> int:
        return self.pipeline_ranks * self.data_parallel

    @property
    def replicated(self) -> bool:
        return self.chunk_replicas is not None and any(r > 1 for r in self.chunk_replicas)

    def replicas_of(self, chunk: int) -> int:
        return 1 if self.chunk_replicas is None else self.chunk_replicas[chunk]

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica of a global rank."""
        return rank // self.pipeline_ranks

    def pipeline_rank_of(self, rank: int) -> int:
        """The position of a global rank within its data-parallel replica."""
        return rank % self.pipeline_ranks

    def global_rank(self, replica: int, pipeline_rank: int) -> int:
        return replica * self.pipeline_ranks + pipeline_rank

    def positions_of(self, chunk: int) -> List[int]:
        """The positions holding a chunk (one unless the stage is replicated)."""
        first = self.chunk_device[chunk]
        return list(range(first, first + self.replicas_of(chunk)))

    def position_of(self, chunk: int, micro_batch: int) -> int:
        """The position that runs `micro_batch` through `chunk` (round-robin over replicas)."""
        return self.chunk_device[chunk] + micro_batch % self.replicas_of(chunk)

    def chunks_of(self, pipeline_rank: int) -> List[int]:
        """Global chunk indices run by a position, in model order."""
        return [g for g in range(self.num_chunks) if pipeline_rank in self.positions_of(g)]

    def lane_of(self, pipeline_rank: int) -> int:
        """Which replica of its stage a position is (0 unless the stage is replicated)."""
        return pipeline_rank - self.chunk_device[self.chunks_of(pipeline_rank)[0]]

    def micro_batches_of(self, pipeline_rank: int, chunk: int, num_micro_batches: int) -> List[int]:
        """The micro-batches a position runs through one of its chunks."""
        r, lane = self.replicas_of(chunk), pipeline_rank - self.chunk_device[chunk]
        return [i for i in range(num_micro_batches) if i % r == lane]

    def data_parallel_group(self, pipeline_rank: int) -> List[int]:
        """All global ranks holding the same chunks as this position: its stage's replicas in
        every data-parallel replica. Their gradients are all-reduced before the optimizer step."""
        chunks = self.chunks_of(pipeline_rank)
        same = [q for q in range(self.pipeline_ranks) if self.chunks_of(q) == chunks]
        return [self.global_rank(r, q) for r in range(self.data_parallel) for q in same]

    def primary_positions(self) -> List[int]:
        """One position per distinct set of chunks (lane 0): whose state stands for the model."""
        return [q for q in range(self.pipeline_ranks) if self.lane_of(q) == 0]


def topology_of(stage_devices: Sequence[Optional[int]], stage_replicas: Sequence[Any], schedule: str,
                num_micro_batches: int, virtual_stages: int = 1, pipeline_ranks: Optional[int] = None,
                data_parallel: int = 1) -> Topology:
    """The topology of a plan's S stages, from its fields: stage_devices[g] is stage g's "device"
    (None: the default), stage_replicas[g] its "replicas", pipeline_ranks the plan's
    pipeline_stages (None: S / v, or the sum of the replicas). TopologyError says what does not fit."""
    num_chunks = len(stage_devices)
    v, d = virtual_stages, data_parallel
    replicas = tuple(stage_replicas)
    for g, r in enumerate(replicas):
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise TopologyError(f"plan stage {g} has replicas {r!r}, expected an integer >= 1; re-run `planner solve`")
    if d < 1:
        raise TopologyError(f"data_parallel must be >= 1 (got {d})")
    if any(r > 1 for r in replicas):
        return _replicated_topology(stage_devices, replicas, schedule, num_micro_batches, v, pipeline_ranks, d)
    p = pipeline_ranks or (num_chunks // v if v >= 1 else 0)
    if p < 1 or v < 1 or p * v != num_chunks:
        raise TopologyError(f"the plan has {num_chunks} stages but pipeline_stages={p} x virtual_stages={v}; "
                            "re-run `planner solve`")
    devices = tuple(g % p if dev is None else dev for g, dev in enumerate(stage_devices))
    for g, dev in enumerate(devices):
        if not 0 <= dev < p:
            raise TopologyError(f"plan stage {g} is placed on device {dev}, outside 0..{p - 1}")
    for rank in range(p):
        if not any(dev == rank for dev in devices):
            raise TopologyError(f"pipeline rank {rank} runs no stage of the plan")
    return Topology(num_chunks=num_chunks, pipeline_ranks=p, virtual_stages=v, data_parallel=d,
                    chunk_device=devices)


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
    return Topology(num_chunks=len(replicas), pipeline_ranks=p, virtual_stages=1, data_parallel=d,
                    chunk_device=offsets, chunk_replicas=replicas)


def instruction_lists(topology: Topology, schedule: str, num_micro_batches: int) -> List[List[sched.Action]]:
    """Every pipeline rank's instruction list (planner.pipeline.schedule.build_schedule)."""
    return sched.build_schedule(schedule, topology.num_chunks, num_micro_batches, topology.virtual_stages,
                                topology.chunk_device, topology.chunk_replicas)
