"""The single-process reference of local SGD (runtime.localsgd), and a replica's state from a run's
checkpoint (a run saves replica 0's alone)."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from planner.model.entry import build_spec
from planner.model.spec import call_model
from planner.plan.file import Plan
from planner.profile.subnormal import flushed
from runtime import checkpoint as ckpt
from runtime.microbatch import split_micro_batches
from runtime.options import TrainOptions
from runtime.stage import build_rank, stage_state
from runtime.training import lr_at


def local_sgd_reference(plan: Plan, *args, **kwargs) -> List[Dict[str, torch.Tensor]]:
    """`_local_sgd_reference` computing as the plan's ranks do (subnormals flushed where the profile was)."""
    with flushed(plan.flush_subnormals):
        return _local_sgd_reference(plan, *args, **kwargs)


def _local_sgd_reference(plan: Plan, steps: int, sync_every: int, lr: float = 0.05, optimizer: str = "sgd",
                        training: Optional[Dict[str, object]] = None) -> List[Dict[str, torch.Tensor]]:
    """d model copies from the same initial state, copy r trained alone on replica r's m
    micro-batches of each global batch (samples [r G/d, (r+1) G/d), as the runtime splits them),
    loss / m, its own optimizer; after every sync_every-th step each trainable parameter and
    floating-point buffer is replaced by its mean over the copies (their sum in replica order / d).
    Returns each copy's final state_dict."""
    torch.set_num_threads(1)
    d, m, G = plan.data_parallel, plan.num_micro_batches, plan.global_batch
    options = TrainOptions(optimizer=optimizer, lr=lr, total_steps=steps, **(training or {}))
    specs = [build_spec(plan.model["entry"], plan.model.get("args", {}), int(plan.model.get("seed", 0)))
             for _ in range(d)]
    optimizers = []
    for spec in specs:
        params = list(spec.module.parameters())
        optimizers.append(torch.optim.SGD(params, lr=lr, momentum=options.momentum, weight_decay=options.decay)
                          if optimizer == "sgd" else
                          torch.optim.AdamW(params, lr=lr, betas=options.betas, weight_decay=options.decay))
    for step in range(steps):
        for r, (spec, opt) in enumerate(zip(specs, optimizers)):
            inputs, target = spec.batch(G, step)
            mine = split_micro_batches([tuple(inputs), target], G, d, "batch")[r]
            micro_inputs = split_micro_batches(mine[0], G // d, m, "inputs")
            micro_targets = split_micro_batches(mine[1], G // d, m, "target")
            for i in range(m):
                (spec.loss(call_model(spec.module, micro_inputs[i]), micro_targets[i]) / m).backward()
            for group in opt.param_groups:
                group["lr"] = lr_at(options, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % sync_every == 0:
            _average([spec.module for spec in specs])
    return [{k: v.detach().clone() for k, v in spec.module.state_dict().items()} for spec in specs]


@torch.no_grad()
def _average(modules: List[torch.nn.Module]) -> None:
    trained = [[p for p in module.parameters() if p.requires_grad] for module in modules]
    buffers = [[b for b in module.buffers() if b.is_floating_point()] for module in modules]
    for copies in list(zip(*trained)) + list(zip(*buffers)):
        total = copies[0].clone()
        for t in copies[1:]:
            total += t
        total /= len(copies)
        for t in copies:
            t.copy_(total)


def replica_state(plan: Plan, checkpoint_dir: str, completed_steps: int, replica: int) -> Dict[str, torch.Tensor]:
    """The whole model's state_dict as replica `replica`'s ranks checkpointed it after that step."""
    topology = plan.topology()
    state: Dict[str, torch.Tensor] = {}
    for position in range(topology.pipeline_ranks):
        rank_model = build_rank(plan, topology, position)
        saved = ckpt.load_rank(checkpoint_dir, completed_steps, topology.global_rank(replica, position))["chunks"]
        for stage in rank_model.stages:
            stage.module.load_state_dict(saved[str(stage.index)])
            state.update(stage_state(stage, rank_model.spec))
    return state
