"""Process groups for the gradient reductions at the end of a step, and the reductions themselves."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from planner.pipeline.actions import Action, ActionKind
from planner.pipeline.topology import Topology
if TYPE_CHECKING:  # annotations only: runtime.shard_params imports this module without the stages
    from runtime.stage import RankModel


class Groups:
    """Process groups for gradient reductions, created by every rank in the same order, as
    torch.distributed requires:

    - holders of the same stages (a stage's lanes, in every data-parallel replica): their
      gradients are summed in buckets (GradientBuckets);
    - tied weights used by stages on several pipeline ranks: one group of every rank holding a use,
      in every replica, whose sum is the whole gradient (so tied parameters skip the first); under
      local SGD (`per_replica`: each replica trains alone, runtime.localsgd) one group per replica;
    - on request (`pipeline_group`, torch's pipelining engine), each replica's pipeline.
    """

    def __init__(self, topology: Topology, rank: int, tied_groups: List[Tuple[str, Tuple[int, ...]]],
                 per_replica: bool = False):
        self.topology, self.rank = topology, rank
        self.tie_groups: Dict[str, Any] = {}
        self.tie_ranks: Dict[str, Tuple[int, ...]] = {}  # each tie group's global ranks
        # each tie's shared-memory all-reduce where its holders share this host (runtime.rank_transport)
        self.tie_reducers: Dict[str, Any] = {}
        self.tie_reached: Dict[str, bool] = {}  # whether some holder's backward reaches the tie
        self.data_parallel_group = None  # the holders of this rank's stages, when more than one
        self.data_parallel_ranks: Tuple[int, ...] = ()  # their global ranks
        if not dist.is_initialized():
            return
        made = set()
        for position in range(topology.pipeline_ranks):
            ranks = tuple(topology.data_parallel_group(position))
            if len(ranks) > 1 and ranks not in made:
                made.add(ranks)
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    self.data_parallel_group, self.data_parallel_ranks = group, ranks
        for name, positions in tied_groups:
            spans = [range(topology.data_parallel)] if not per_replica else \
                [[r] for r in range(topology.data_parallel)]
            for replicas in spans:
                ranks = [topology.global_rank(r, q) for r in replicas for q in positions]
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.tie_groups[name], self.tie_ranks[name] = group, tuple(ranks)

    def pipeline_group(self) -> Any:
        """The ranks of this rank's pipeline (None: all of them, with one replica). Every rank asks
        once, at the same point: each creates every replica's group, in the same order, as
        torch.distributed requires."""
        topology, mine = self.topology, None
        if topology.data_parallel == 1:
            return None
        for replica in range(topology.data_parallel):
            ranks = [topology.global_rank(replica, q) for q in range(topology.pipeline_ranks)]
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def reduce_gradients(self, rank_model: RankModel, buckets: Optional["GradientBuckets"]) -> None:
        """Sum the tied weights' gradients over their holders, then finish the data-parallel
        buckets (those the last backward did not already start)."""
        for name, (param, _) in rank_model.tied.items():
            group = self.tie_groups[name]
            if name not in self.tie_reached:  # asked once: every step runs the same graphs
                flag = torch.tensor([float(param.grad is not None)], device=param.device)
                dist.all_reduce(flag, group=group)
                self.tie_reached[name] = bool(flag.item() > 0)
            sum_gradient(param, group, self.tie_reducers.get(name))
            if not self.tie_reached[name]:  # no holder's backward reached it: None, as in one process
                param.grad = None
        if buckets is not None:
            buckets.finish()


def sum_gradient(param: torch.nn.Parameter, group: Any, reducer: Any = None) -> None:
    """Sum a parameter's gradient over `group` in place (through `reducer`, a shared-memory
    all-reduce over the same ranks, where given); one that got none this step joins with zeros
    (every member must take part)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    if reducer is not None:  # every member has one, or none has (shared_reduce.reducer)
        flat = param.grad.contiguous()
        reducer.all_reduce(flat, counted=False)
        if flat is not param.grad:
            param.grad.copy_(flat)
    else:
        dist.all_reduce(param.grad, group=group)


class GradientBuckets:
    """The data-parallel all-reduce, bucketed and overlapped with the last backward.

    Each parameter's gradient lies in a flat bucket (about `bucket_bytes`, parameters in
    reverse order, as backward produces them), so no gradient is copied. `begin_step` zeroes the
    buckets and points the gradients at them; `arm(params)` before a stage's last backward of the
    step makes each parameter's post-accumulate hook count it done, and a bucket whose parameters
    are all done starts its all-reduce at once, asynchronously, while the backward goes on.
    `finish` starts the rest (parameters without a gradient this step) in bucket order and waits
    for all. With a reducer (`use_reducer`, runtime/shared_reduce.py: every holder on this host)
    `finish` sums the buckets through shared memory instead, in bucket order, where the step graph
    charges the exchange: after the rank's list (planner/pipeline/stepgraph.py); nothing starts
    early, so the hooks go (a Python call per parameter and backward). Either way a parameter's
    gradient tensor's own version counter tells `finish` whether a backward reached it. Every
    holder runs the same graphs, so the buckets start in the same order everywhere, and a
    parameter no backward reached on one holder was reached on none: its gradient is None again
    after `finish`, as single-process training leaves it (an optimizer skips it).
    """

    def __init__(self, params: List[torch.nn.Parameter], group: Any, bucket_bytes: int = 25 << 20):
        self.group = group
        self.reducer = None  # runtime.shared_reduce.SharedMemoryReducer, set once the transport is up
        self.buckets: List[torch.Tensor] = []
        self.members: List[List[Tuple[torch.nn.Parameter, torch.Tensor]]] = []
        self.bucket_of: Dict[int, int] = {}
        current: List[torch.nn.Parameter] = []
        for p in reversed(params):
            if current and (p.dtype != current[0].dtype or p.device != current[0].device or
                            sum(q.numel() * q.element_size() for q in current) >= bucket_bytes):
                self._add(current)
                current = []
            current.append(p)
        if current:
            self._add(current)
        self.pending: List[int] = []
        self.works: List[Any] = []
        self.started: List[bool] = []
        self.armed: set = set()
        self.versions: List[List[int]] = []  # per bucket, its gradients' versions as the step began
        self.hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]

    def use_reducer(self, reducer) -> None:
        """Sum through `reducer` (or gloo where None) from now on; with one, no hooks."""
        self.reducer = reducer
        if reducer is not None:
            for hook in self.hooks:
                hook.remove()
            self.hooks = []

    def _add(self, params: List[torch.nn.Parameter]) -> None:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            # a tensor of its own over the bucket's memory, not a view: its version counter is its own
            # (a view shares its base's), so an accumulation into it shows on it alone
            grad = torch.empty(0, dtype=flat.dtype, device=flat.device)
            views.append((p, grad.set_(flat.untyped_storage(), offset, p.shape)))
            self.bucket_of[id(p)] = len(self.buckets)
            offset += p.numel()
        self.buckets.append(flat)
        self.members.append(views)

    def begin_step(self) -> None:
        for flat, views in zip(self.buckets, self.members):
            flat.zero_()
            for p, view in views:
                p.grad = view
        self.versions = [[view._version for _, view in views] for views in self.members]
        self.pending = [len(views) for views in self.members]
        self.works = [None] * len(self.buckets)
        self.started = [False] * len(self.buckets)
        self.armed.clear()

    def arm(self, params: List[torch.nn.Parameter]) -> None:
        self.armed.update(id(p) for p in params)

    def _accumulated(self, p: torch.nn.Parameter) -> None:
        if id(p) not in self.armed:
            return
        self.armed.discard(id(p))
        k = self.bucket_of[id(p)]
        self.pending[k] -= 1
        if self.pending[k] == 0:
            self._start(k)

    def _start(self, k: int) -> None:
        for p, view in self.members[k]:  # autograd may have replaced a gradient: put it back in the bucket
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        self.started[k] = True
        if self.reducer is None:  # gloo's, in the background while the backward goes on
            self.works[k] = dist.all_reduce(self.buckets[k], group=self.group, async_op=True)

    def finish(self) -> None:
        # reached this step: autograd accumulated into the gradient, or replaced it (a started bucket
        # has put it back, and that copy moved the version)
        reached = {id(p) for views, versions in zip(self.members, self.versions)
                   for (p, view), version in zip(views, versions) if p.grad is not view or view._version != version}
        for k in range(len(self.buckets)):
            if not self.started[k]:
                self._start(k)
        if self.reducer is not None:
            for flat in self.buckets:
                self.reducer.all_reduce(flat)
        for work in self.works:
            if work is not None:
                work.wait()
        for views in self.members:
            for p, _ in views:
                if id(p) not in reached:
                    p.grad = None


def data_parallel_buckets(rank_model: RankModel, group: Any) -> Tuple["GradientBuckets", Set[int]]:
    """The buckets of a rank's trainable parameters over its data-parallel group, and the ids of its
    tied parameters, which the ties' own all-reduce sums instead (Groups.reduce_gradients)."""
    tied = {id(param) for param, _ in rank_model.tied.values()}
    return GradientBuckets([p for p in rank_model.trainable() if id(p) not in tied], group), tied


def last_backwards(actions: List[Action], stages: Dict[int, Any], tied: Set[int]
               ) -> Dict[Tuple[int, int], List[torch.nn.Parameter]]:
    """For the data-parallel buckets: (stage, micro-batch) of each backward after which a
    parameter gets no more gradient this step (the last backward of the last stage here using it;
    under a zero-bubble schedule the last weight backward, which is where parameters' gradients grow);
    frozen parameters (requires_grad=False) get none and are not listed."""
    last: Dict[int, Tuple[int, int]] = {}  # stage -> its last backward's position and micro-batch
    for k, a in enumerate(actions):
        if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            last[a.stage] = (k, a.micro_batch)
    final: Dict[int, Tuple[int, int, int]] = {}  # parameter -> (position, stage, micro-batch)
    params: Dict[int, torch.nn.Parameter] = {}
    for g, stage in stages.items():
        if g not in last:
            continue
        for p in stage.module.parameters():
            if id(p) in tied or not p.requires_grad:
                continue
            params[id(p)] = p
            candidate = (last[g][0], g, last[g][1])
            final[id(p)] = max(final.get(id(p), candidate), candidate)
    arming: Dict[Tuple[int, int], List[torch.nn.Parameter]] = {}
    for pid, (_, g, i) in final.items():
        arming.setdefault((g, i), []).append(params[pid])
    return arming
