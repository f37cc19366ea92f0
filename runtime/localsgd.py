"""Local SGD (a plan's `sync_every` H > 1): every data-parallel replica trains alone, and after every
H-th step the replicas average their models.

Between averagings nothing crosses the data-parallel link: a replica's loss is scaled by 1/m (it
is a trainer of its own, not 1/d of one), its optimizer steps on its own gradients, and a weight
tied across pipeline ranks has its gradient summed over the holders in its own replica only
(runtime.groups). After the optimizer step of step s (0-based) with (s + 1) % H == 0 every rank
replaces each of its trainable parameters and floating-point buffers (BatchNorm's running
statistics) by their mean over the replicas holding them: all_reduce(SUM) / d on the data-parallel
group, on the device (NCCL's collective on GPUs). Optimizer state (momentum, Adam's moments) stays
each replica's own; frozen parameters never differ; integer buffers (batch counts) are equal in
every replica, which all run the same number of micro-batches.

The step counter is the run's: a run resumed from a checkpoint averages after the same steps as
one that never stopped (each rank checkpoints its own replica's state). A run whose step count is
not a multiple of H ends with its replicas apart since the last averaging; the state it saves is
replica 0's (`runtime execute` says so).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from runtime.stage import RankModel


class ModelAverager:
    """Averages a rank's trainable parameters and floating-point buffers over its data-parallel
    group every `every` steps (after the optimizer step)."""

    def __init__(self, rank_model: RankModel, group: Any, replicas: int, every: int):
        self.group = group
        self.replicas = replicas
        self.every = every
        seen, tensors = set(), []
        buffers = [b for stage in rank_model.stages for b in stage.module.buffers() if b.is_floating_point()]
        for t in list(rank_model.trainable()) + buffers:
            if id(t) not in seen:
                seen.add(id(t))
                tensors.append(t)
        # one flat all-reduce per (dtype, device): every replica lists its tensors in the same order
        self.groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        for t in tensors:
            self.groups.setdefault((t.dtype, t.device), []).append(t)

    def due(self, step: int) -> bool:
        """Whether the replicas average after step `step` (0-based) of the run."""
        return (step + 1) % self.every == 0

    @torch.no_grad()
    def average(self) -> None:
        for tensors in self.groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat.div_(self.replicas)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def run_refusal(sync_every: int, clip_grad_norm: Optional[float]) -> Optional[str]:
    """Why a local-SGD plan cannot run with these options (one line: cause and fix), or None."""
    if sync_every > 1 and clip_grad_norm is not None:
        return ("--clip-grad-norm with a local-SGD plan (sync_every > 1) is not supported: each replica would clip "
                "by its own norm; drop the clipping, or re-plan with --local-sgd-max 1")
    return None


def end_note(sync_every: int, steps: int) -> Optional[str]:
    """What a run whose last step does not average ends with (None when it averages)."""
    if sync_every <= 1 or steps % sync_every == 0:
        return None
    return (f"note: local SGD averages the replicas every {sync_every} steps and {steps} is not a multiple: the "
            f"last {steps % sync_every} step(s) leave the replicas apart; the saved state is replica 0's")
