"""Process groups for the gradient reductions at the end of a step, and the reductions themselves."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from planner.pipeline.topology import Topology
from runtime.stage import RankModel


class Groups:
    """Process groups for gradient reductions, created by every rank in the same order, as
    torch.distributed requires:

    - holders of the same stages (a stage's lanes, in every data-parallel replica): their
      gradients are summed in one flat all-reduce;
    - tied weights used by stages on several pipeline ranks: one group of every rank holding a use,
      in every replica, whose sum is the whole gradient (so tied parameters skip the first).
    """

    def __init__(self, topology: Topology, rank: int, tied_groups: List[Tuple[str, Tuple[int, ...]]]):
        self.topology = topology
        self.tie_groups: Dict[str, Any] = {}
        self.data_parallel_group = None  # the holders of this rank's stages, when more than one
        if not dist.is_initialized():
            return
        made = set()
        for position in range(topology.pipeline_ranks):
            ranks = tuple(topology.data_parallel_group(position))
            if len(ranks) > 1 and ranks not in made:
                made.add(ranks)
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    self.data_parallel_group = group
        for name, positions in tied_groups:
            ranks = [topology.global_rank(r, q) for r in range(topology.data_parallel) for q in positions]
            group = dist.new_group(ranks)
            if rank in ranks:
                self.tie_groups[name] = group

    def reduce_gradients(self, rank_model: RankModel, params: List[torch.nn.Parameter]) -> None:
        tied = set()
        for name, (param, _) in rank_model.tied.items():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=self.tie_groups[name])
            tied.add(id(param))
        if self.data_parallel_group is not None:
            own = [p for p in params if id(p) not in tied]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in own]
            for p, g in zip(own, grads):
                p.grad = g
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.data_parallel_group)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
