"""A rank's step loop (runtime.worker): its steps, each step's loss over the last stage's holders,
checkpoints, and the host's speed timed around them."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from planner.profile.hostspeed import reference_kernel_s
from runtime import checkpoint as ckpt
from runtime.groups import Groups
from runtime.rank_setup import RankProcess
from runtime.rank_transport import shared_reducer
from runtime.streams import start_stream
from runtime.training import lr_at, set_lr


def time_host(device: torch.device) -> Optional[float]:
    """The host's speed, timed by all ranks at once as they compute (CPU hosts only: shared cores
    are what drifts; on a GPU the kernel is not timed and no barriers are needed)."""
    if device.type != "cpu":
        return None
    dist.barrier()
    return reference_kernel_s(0.05, device=device)


def train_steps(me: RankProcess, first_step: int) -> List[Dict[str, Any]]:
    """Steps first_step .. --steps, checkpointing every --checkpoint-every; each step's statistics."""
    args, topology, rank = me.args, me.topology, me.rank
    if me.device.type == "cpu":
        dist.barrier()  # every rank timed the host before any starts its steps
    is_reporter = me.pipeline_rank == topology.reporting_rank() and topology.replica_of(rank) == 0
    steps = []
    if me.resumed_rng is not None:
        ckpt.set_rng_state(me.resumed_rng)
    else:  # each rank's own random stream (runtime.streams)
        start_stream(int(me.plan.model.get("seed", 0)), rank, me.rank_model.built_rng_state)
    for step in range(first_step, args.steps):
        set_lr(me.optimizer, lr_at(me.options, step))
        stats = me.engine.run_step(step)
        if me.groups.data_parallel_group is not None and me.rank_model.stages[-1].is_last:
            stats.loss = _mean_over_holders(stats, me.groups, shared_reducer(me))
        steps.append(dict(stats.__dict__))
        if args.progress and is_reporter:
            print(f"step {step + 1}/{args.steps}  loss {stats.loss:.4f}  time {stats.time_s * 1e3:.1f} ms",
                  flush=True)
        if args.checkpoint_dir and args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0:
            ckpt.save_rank(args.checkpoint_dir, step + 1, rank,
                           {str(st.index): st.module.state_dict() for st in me.rank_model.stages},
                           me.optimizer.state_dict())
            dist.barrier()  # every rank's file is in place before the step is marked complete
            if rank == 0:
                ckpt.mark_complete(args.checkpoint_dir, step + 1, me.digest, me.world)
    return steps


def _mean_over_holders(stats, groups: Groups, reducer=None):
    """Each holder of the last stage (data-parallel replicas, stage replicas) knows the mean loss
    of its own micro-batches; the step's loss is the mean over all of them. Summed through the
    gradient buckets' shared-memory `reducer` where the rank has one (the same group): a gloo
    collective between steps waits on the kernel's wake-ups, time no step's clock sees."""
    total = (stats.loss or 0.0) * stats.loss_count
    value = torch.tensor([total, float(stats.loss_count)], dtype=torch.float64)
    if reducer is not None:
        reducer.all_reduce(value, counted=False)
    else:
        dist.all_reduce(value, group=groups.data_parallel_group)
    return float(value[0] / value[1]) if value[1] > 0 else None
