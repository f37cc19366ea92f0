"""Optimizer state and gradients sharded across a stage's data-parallel replicas (a plan's `shard`:
planner/cost/memory.py), trained exactly as one process.

- `optimizer` (ZeRO-1): torch.distributed.optim.ZeroRedundancyOptimizer over the holders of this
  rank's stages. The gradients are all-reduced as without sharding (runtime.groups.Groups); each
  holder keeps the optimizer state of its share of the parameters, steps them, and broadcasts them
  to the others.
- `gradients` (ZeRO-2): `GradientShardedOptimizer`. Each parameter has one owner among the n
  holders (dealt out in order to the least loaded, by size). Instead of the all-reduce at the end,
  each micro-batch's backward hands every gradient to its owner as soon as it is accumulated (a
  `reduce` per parameter, from a post-accumulate-grad hook) and the others drop theirs: a holder
  keeps whole gradients only for its share, as planner/cost/memory.py counts (and sends m times
  the gradients, as it charges). The owner steps its share (only it has their optimizer state) and
  broadcasts it. gloo has no reduce-scatter: reduces to the owners move the same bytes.

Tied weights (used by stages on several ranks) are summed over every rank holding a use in every
replica by runtime.groups.Groups before the step, so each holder steps its copy itself (not sharded).
`parameters` (ZeRO-3): runtime/shard_params.py.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

def shard_optimizer(shard: str, optimizer_class: type, arguments: Dict[str, Any], params: List[torch.nn.Parameter],
                    tied: List[torch.nn.Parameter], group: Any) -> Optional[Any]:
    """The optimizer (`optimizer_class(params, **arguments)`, runtime.training.optimizer_arguments)
    for a sharded plan over the data-parallel `group` of this rank's stages; None when nothing is
    sharded (no sharding asked, one holder, or no parameters)."""
    if shard == "none" or group is None or not params:
        return None
    if shard == "optimizer":
        return _ZeroOne(params, optimizer_class, arguments, group)
    if shard == "gradients":
        return GradientShardedOptimizer(params, tied, optimizer_class, arguments, group)
    raise ValueError(f"shard {shard!r} is not an optimizer's (parameters: runtime/shard_params.py)")


class _ZeroOne:
    """ZeroRedundancyOptimizer; checkpoints hold each holder's own shard of the state."""

    reduces_gradients = False  # the engine's all-reduce gives every holder the whole gradient

    def __init__(self, params, optimizer_class, arguments: Dict[str, Any], group: Any):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.zero = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=group, **arguments)

    def step(self) -> None:
        self.zero.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.zero.optim.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.zero.optim.load_state_dict(state)


def deal(params: List[torch.nn.Parameter], holders: int) -> List[int]:
    """Owner index (0 .. holders - 1) of each parameter: in order, each to the holder with the
    fewest elements so far (ties: the lowest index)."""
    load, owners = [0] * holders, []
    for p in params:
        owner = min(range(holders), key=lambda h: (load[h], h))
        owners.append(owner)
        load[owner] += p.numel()
    return owners


class GradientShardedOptimizer:
    """ZeRO-2 over `group` (module docstring). The engine skips its data-parallel all-reduce for it
    (`reduces_gradients`); tied parameters are reduced there and stepped by every holder."""

    reduces_gradients = True

    def __init__(self, params: List[torch.nn.Parameter], tied: List[torch.nn.Parameter], optimizer_class,
                 arguments: Dict[str, Any], group: Any):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.me = self.ranks.index(dist.get_rank())
        tied_ids = {id(p) for p in tied}
        self.sharded = [p for p in params if id(p) not in tied_ids]
        self.owners = deal(self.sharded, len(self.ranks))
        mine = [p for p, o in zip(self.sharded, self.owners) if o == self.me]
        own_tied = [p for p in params if id(p) in tied_ids]
        self.local = optimizer_class(mine + own_tied, **arguments) if mine or own_tied else None
        self.params = params
        for p, owner in zip(self.sharded, self.owners):
            p.register_post_accumulate_grad_hook(self._hand_over(self.ranks[owner], owner == self.me))

    def _hand_over(self, owner_rank: int, mine: bool):
        """After each backward that reaches the parameter: its gradient goes to its owner, summed
        with the other holders' (the owner's already holds the earlier micro-batches'); the others
        drop theirs. Every holder runs the same backward, so the reduces pair up in order."""

        def hook(p: torch.nn.Parameter) -> None:
            dist.reduce(p.grad, dst=owner_rank, group=self.group)
            if not mine:
                p.grad = None

        return hook

    def step(self) -> None:
        if self.local is not None:
            self.local.step()
        for owner in range(len(self.ranks)):
            share = [p for p, o in zip(self.sharded, self.owners) if o == owner]
            if not share:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in share])
            dist.broadcast(flat, src=self.ranks[owner], group=self.group)
            if owner != self.me:
                offset = 0
                with torch.no_grad():
                    for p in share:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> Dict[str, Any]:
        return self.local.state_dict() if self.local is not None else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.local is not None:
            self.local.load_state_dict(state)
