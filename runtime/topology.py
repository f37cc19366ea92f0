"""Where every piece of a plan runs: ranks, replicas, pipeline positions and model chunks.

A plan has P = p·v model chunks ("stages" in the plan file, in model order), p pipeline ranks
and d data-parallel replicas of the whole pipeline:

    world size      = d · p
    rank            = replica · p + pipeline_rank
    chunk g         runs on pipeline rank  device(g) = plan stage's "device" (default g mod p)
    local chunk c   of a rank = its c-th chunk in model order (looping placement: g = c · p + rank)

Pure functions of the plan: every rank derives the same topology without talking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Topology:
    num_chunks: int  # P = p · v
    pipeline_ranks: int  # p
    virtual_stages: int  # v
    data_parallel: int  # d
    chunk_device: tuple  # chunk g -> pipeline rank

    @property
    def world_size(self) -> int:
        return self.pipeline_ranks * self.data_parallel

    def replica_of(self, rank: int) -> int:
        return rank // self.pipeline_ranks

    def pipeline_rank_of(self, rank: int) -> int:
        return rank % self.pipeline_ranks

    def global_rank(self, replica: int, pipeline_rank: int) -> int:
        return replica * self.pipeline_ranks + pipeline_rank

    def chunks_of(self, pipeline_rank: int) -> List[int]:
        """Global chunk indices run by a pipeline rank, in model order."""
        return [g for g in range(self.num_chunks) if self.chunk_device[g] == pipeline_rank]

    def data_parallel_group(self, pipeline_rank: int) -> List[int]:
        """The ranks holding the same chunks in every replica (their gradients are all-reduced)."""
        return [self.global_rank(r, pipeline_rank) for r in range(self.data_parallel)]


def topology_of(plan: Dict[str, Any]) -> Topology:
    stages = plan["stages"]
    num_chunks = len(stages)
    v = int(plan.get("virtual_stages", 1) or 1)
    p = int(plan.get("pipeline_stages", num_chunks // v) or num_chunks // v)
    d = int(plan.get("data_parallel", 1) or 1)
    if p < 1 or v < 1 or d < 1 or p * v != num_chunks:
        raise TopologyError(f"the plan has {num_chunks} stages but pipeline_stages={p} x virtual_stages={v}; "
                            "re-run `planner solve`")
    devices = tuple(int(s.get("device", g % p)) for g, s in enumerate(stages))
    for g, dev in enumerate(devices):
        if not 0 <= dev < p:
            raise TopologyError(f"plan stage {g} is placed on device {dev}, outside 0..{p - 1}")
    for rank in range(p):
        if not any(dev == rank for dev in devices):
            raise TopologyError(f"pipeline rank {rank} runs no stage of the plan")
    return Topology(num_chunks=num_chunks, pipeline_ranks=p, virtual_stages=v, data_parallel=d,
                    chunk_device=devices)
