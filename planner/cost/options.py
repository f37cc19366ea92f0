"""What the planner is asked: CostOptions (pipeline ranks, replicas, batch, schedule, hardware)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

from planner.cost.cluster import Cluster
from planner.cost.localsgd import local_sgd_refusal
from planner.cost.placement import Placement
from planner.cost.memory import OPTIMIZER_MOMENTS, PRECISIONS, SHARDS
from planner.pipeline.schedule import (MULTI_STAGE_SCHEDULES, ONE_STAGE_SCHEDULES, SCHEDULES, schedule_virtual_stages,
                                      stage_placement)

RECOMPUTE_MODES = ("none", "all", "auto")
SHARD_CHOICES = SHARDS + ("auto",)  # auto: the solver chooses (a scenario dimension)
DEFAULT_BANDWIDTH = 5e9  # bytes/s between pipeline ranks when nothing better is known


@dataclass(frozen=True)
class CostOptions:
    """What the planner is asked: p pipeline ranks x d data-parallel replicas, a global batch of G
    samples, the schedule and the hardware. The plan then has S = num_stages stages: p·v, or one
    per entry of `replicas` (stage g on r_g of the p ranks)."""

    pipeline_ranks: int  # p: devices per data-parallel replica (sum_g r_g with replicated stages)
    global_batch: int  # G = d * m * b
    schedule: str = "1f1b"
    bandwidth: float = DEFAULT_BANDWIDTH  # bytes/s between consecutive ranks (and for tied-parameter exchange)
    latency: float = 0.0  # seconds per message (one per direction per cut with tensors)
    memory_cap: Optional[float] = None  # bytes per device; None = unlimited
    optimizer: str = "sgd"
    data_parallel: int = 1  # d
    virtual_stages: int = 1  # v
    dp_bandwidth: Optional[float] = None  # all-reduce bandwidth; None = bandwidth
    cluster: Optional[Cluster] = None
    # replicas and ranks on a leveled topology (planner.cost.placement; --topology); not with a cluster
    placement: Optional[Placement] = None
    recompute: str = "none"  # what solvers may choose: none | all | auto
    step_overhead_s: float = 0.0  # fixed time added once per iteration (calibration: what the model misses)
    message_s: float = 0.0  # what the runtime pays per message on each side, besides the transfer
    replicas: Tuple[int, ...] = ()  # r_g per stage (S of them, adding up to p); () = one rank per stage
    # planner.cost.memory: the dtypes of parameters, gradients and state (None: the profile's
    # default, bf16-mixed for a half-precision profile, else fp32), how the data-parallel holders of
    # a stage shard them, and the bytes kept free on every device (None: the profile's device default)
    precision: Optional[str] = None
    shard: str = "none"
    reserve_bytes: Optional[float] = None
    # H: the data-parallel replicas exchange gradients every step (1), or train alone and average
    # their models every H > 1 steps: local SGD (planner.cost.localsgd)
    sync_every: int = 1

    @property
    def replicated(self) -> bool:
        return any(r != 1 for r in self.replicas)

    @property
    def num_stages(self) -> int:
        """S: the plan's stages (p·v, or one per replicated stage)."""
        return len(self.replicas) if self.replicas else self.pipeline_ranks * self.virtual_stages

    @property
    def local_sgd(self) -> bool:
        """The replicas average their models every H > 1 steps instead of all-reducing gradients."""
        return self.sync_every > 1 and self.data_parallel > 1

    @property
    def tie_replicas(self) -> int:
        """The replicas a tied weight's gradient all-reduce spans: every one, or, under local SGD,
        its own alone (each replica trains by itself)."""
        return 1 if self.local_sgd else self.data_parallel

    def rank_of_stage(self, g: int) -> int:
        """The pipeline rank running stage g (unreplicated): the schedule's placement."""
        return stage_placement(self.schedule, self.num_stages, self.virtual_stages)[g]

    def stages_on(self, rank: int) -> List[int]:
        """The stages pipeline rank `rank` runs (unreplicated), in model order."""
        return [g for g in range(self.num_stages) if self.rank_of_stage(g) == rank]

    @property
    def device_view(self):
        """What the cost model reads of the devices per pipeline rank (speed, memory, links): the
        placement's or the cluster's view, None for identical devices on one link."""
        return self.placement if self.placement is not None else self.cluster

    def with_(self, **changes) -> "CostOptions":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        if self.pipeline_ranks < 1:
            raise ValueError(f"the number of stages must be at least 1 (got {self.pipeline_ranks})")
        if self.global_batch < 1:
            raise ValueError(f"the global batch must be at least 1 (got {self.global_batch})")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if self.schedule in MULTI_STAGE_SCHEDULES and self.virtual_stages < 2:
            raise ValueError(f"schedule {self.schedule} needs --virtual-stages >= 2 (got {self.virtual_stages})")
        fixed = schedule_virtual_stages(self.schedule)
        if fixed is not None and self.virtual_stages != fixed:
            raise ValueError(f"schedule {self.schedule} runs {fixed} stage(s) per device, not --virtual-stages "
                             f"{self.virtual_stages}" + ("" if fixed == 2 else "; use interleaved or bfs for several"))
        if self.data_parallel < 1:
            raise ValueError(f"the data-parallel degree must be at least 1 (got {self.data_parallel})")
        for name, value in (("bandwidth", self.bandwidth), ("dp bandwidth", self.dp_bandwidth)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive bytes/s (got {value})")
        if not self.step_overhead_s >= 0:
            raise ValueError(f"the step overhead must be >= 0 seconds (got {self.step_overhead_s})")
        if not self.message_s >= 0:
            raise ValueError(f"the per-message cost must be >= 0 seconds (got {self.message_s})")
        if self.latency < 0:
            raise ValueError(f"latency must be >= 0 seconds (got {self.latency})")
        if self.memory_cap is not None and not self.memory_cap > 0:
            raise ValueError(f"memory per device must be positive bytes (got {self.memory_cap})")
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(sorted(OPTIMIZER_MOMENTS))}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if self.shard not in SHARD_CHOICES:
            raise ValueError(f"unknown shard {self.shard!r}; use one of {', '.join(SHARD_CHOICES)}")
        if self.reserve_bytes is not None and not self.reserve_bytes >= 0:
            raise ValueError(f"the reserve must be >= 0 bytes per device (got {self.reserve_bytes})")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"unknown recompute mode {self.recompute!r}; use one of {', '.join(RECOMPUTE_MODES)}")
        if self.replicas:
            self._validate_replicas()
        if not isinstance(self.sync_every, int) or isinstance(self.sync_every, bool) or self.sync_every < 1:
            raise ValueError(f"the model averaging period H must be an integer >= 1 (got {self.sync_every!r})")
        refusal = local_sgd_refusal(self.sync_every, self.shard, self.replicated, self.placement is not None)
        if refusal:
            raise ValueError(refusal)
        if self.cluster is not None and self.cluster.num_devices != self.pipeline_ranks:
            raise ValueError(f"the cluster has {self.cluster.num_devices} devices but {self.pipeline_ranks} "
                             "pipeline stages were asked; give --stages equal to the cluster's device count")
        if self.placement is not None:
            self._validate_placement()

    def _validate_replicas(self) -> None:
        if any(not isinstance(r, int) or r < 1 for r in self.replicas) or sum(self.replicas) != self.pipeline_ranks:
            raise ValueError(f"replicas must give one integer >= 1 per stage, adding up to the {self.pipeline_ranks} "
                             f"pipeline ranks; got {list(self.replicas)}")
        if self.replicated and (self.schedule not in ONE_STAGE_SCHEDULES or self.cluster is not None):
            raise ValueError(f"replicated stages need schedule gpipe or 1f1b (got {self.schedule}) and no --cluster")

    def _validate_placement(self) -> None:
        placement = self.placement
        placement.validate()
        if (placement.pipeline_ranks, placement.data_parallel) != (self.pipeline_ranks, self.data_parallel):
            raise ValueError(f"the placement has {placement.data_parallel} replica(s) of {placement.pipeline_ranks} "
                             f"rank(s) but the plan {self.data_parallel} of {self.pipeline_ranks}")
        if self.cluster is not None or self.replicated:
            raise ValueError("a topology placement does not combine with --cluster or replicated stages")
