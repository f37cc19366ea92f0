"""Modules that update buffers in their training forward: the running statistics of BatchNorm and
of InstanceNorm built with `track_running_stats=True` (without it neither holds any).

Rule: a stage holding one cannot be replicated (PipeDream-style stage replicas, `planner solve
--replicate`): each replica would see only its own micro-batches and keep its own statistics, so no
one state equals single-process training. The profile marks such units (`UnitProfile.running_stats`),
the solver keeps them on one device per data-parallel replica, and the runtime refuses a plan that
replicates one (runtime.stage). Data-parallel replicas are a different matter: each keeps its own
statistics, as DDP without SyncBatchNorm does, and the saved state is replica 0's.
"""
from __future__ import annotations

from torch import nn


def keeps_running_statistics(module: nn.Module) -> bool:
    """Whether `module` or a submodule is a normalisation that tracks running statistics (BatchNorm
    and InstanceNorm of any dimension, SyncBatchNorm included)."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats for m in module.modules())
