"""What a training run adds to the pipeline: the optimizer and its options, the learning-rate
schedule, gradient clipping by the global norm, and the precision.

Precision `bf16-mixed` is `torch.autocast(bfloat16)` around every forward and loss, computing with
one bf16 copy of the weights per step, fp32 master parameters, fp32 gradients accumulated from each
micro-batch's bf16 ones, fp32 optimizer state (planner.model.precision): a single process training the
same way is the reference (tests: equal to it within 1e-5), and the memory per parameter is fp32's
(4 bytes of weight, 4 of gradient, the optimizer's state) plus 2 bytes of the bf16 copy,
activations mostly bf16.

The schedule is a function of the step number alone (warm-up from lr/warmup to lr over `warmup`
steps, then constant or a cosine down to `min_lr` at the run's last step), so a resumed run sets
the same rates without any scheduler state.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from runtime.options import TrainOptions


def optimizer_arguments(options: TrainOptions) -> Tuple[type, Dict[str, Any]]:
    """The torch optimizer class and its keyword arguments for these options: every optimizer of a
    run gets them, unsharded or sharded (runtime/shard.py, runtime/shard_params.py)."""
    if options.optimizer == "sgd":
        return torch.optim.SGD, dict(lr=options.lr, momentum=options.momentum, weight_decay=options.decay)
    if options.optimizer == "adam":  # its weight decay an L2 term, as SGD's
        return torch.optim.Adam, dict(lr=options.lr, betas=options.betas, weight_decay=options.decay)
    return torch.optim.AdamW, dict(lr=options.lr, betas=options.betas, weight_decay=options.decay)


def make_optimizer(options: TrainOptions, params: List[torch.nn.Parameter]) -> Any:
    from planner.profile.optim import make_optimizer as bare

    if not params:
        return bare(options.optimizer, params, options.lr)  # a rank without parameters
    optimizer_class, arguments = optimizer_arguments(options)
    return optimizer_class(params, **arguments)


def lr_at(options: TrainOptions, step: int) -> float:
    """The learning rate of step `step` (0-based)."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    if options.schedule == "constant":
        return options.lr
    span = max(options.total_steps - options.warmup_steps - 1, 1)
    progress = min((step - options.warmup_steps) / span, 1.0)
    return options.min_lr + (options.lr - options.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: Any, lr: float) -> None:
    """Every parameter group's rate (a sharded optimizer's inner one too: runtime/shard.py)."""
    inner = getattr(optimizer, "zero", None) or getattr(optimizer, "local", None) or optimizer
    for group in getattr(inner, "param_groups", []):
        group["lr"] = lr


class GlobalNormClip:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), the norm over the whole model's
    gradients (torch.nn.utils.clip_grad_norm_'s rule), after the gradient reductions: each rank adds
    the squares of the gradients it owns, counted once: a weight tied across ranks by its first
    holder, a replicated stage by its first lane, and data-parallel replicas (equal after the
    all-reduce) by replica 0; one all-reduce sums them."""

    def __init__(self, max_norm: float, params: List[torch.nn.Parameter], counted: List[bool], device: torch.device,
                 distributed: bool):
        self.max_norm = max_norm
        self.params = params
        self.counted = counted
        self.device = device
        self.distributed = distributed
        self.last_norm: Optional[float] = None

    def __call__(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        mine = [p.grad for p, c in zip(self.params, self.counted) if c and p.grad is not None]
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if mine:
            total = total + torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in mine]).sum()
        if self.distributed:
            dist.all_reduce(total)
        norm = total.sqrt()
        coefficient = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
        self.last_norm = norm  # a tensor: read after the step's synchronisation
