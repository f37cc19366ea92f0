"""Execute one rank's instruction list, step after step.

A step: `inputs, target = batch(G, step)`; replica r of d takes samples [r·G/d, (r+1)·G/d) and
splits them into m equal micro-batches along dim 0. The last chunk's loss for micro-batch i is
`loss(output_i, target_i) / (d·m)`, so after the gradient all-reduce (a sum over replicas) every
parameter holds the gradient of the mean micro-batch loss, exactly as single-device gradient
accumulation over the same d·m micro-batches computes it. A replicated stage's replicas each
run their share of the micro-batches (round-robin) and sum gradients the same way. Tied weights
used on several ranks get their gradients summed across all their holders. One optimizer step
per rank ends the step.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from planner.model.spec import to_device
from planner.profile.saved import SavedBytes
from planner.pipeline import schedule as sched
from runtime.comm import ACTIVATION, GRADIENT, PointToPoint, PostedRecv
from runtime.stage import Chunk, RankModel
from planner.pipeline.topology import Topology


class BatchError(ValueError):
    """The model's batch function does not produce what the plan needs."""


def split_micro_batches(obj: Any, total: int, parts: int, what: str) -> List[Any]:
    """Split every tensor in `obj` (tensor, tuple, list, dict) into `parts` equal parts along dim 0."""
    size = total // parts
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] != total:
            raise BatchError(f"{what} has shape {tuple(obj.shape)}; every batch tensor needs the batch "
                             f"({total}) on dim 0")
        return [obj.narrow(0, i * size, size) for i in range(parts)]
    if isinstance(obj, (tuple, list)):
        split = [split_micro_batches(o, total, parts, f"{what}[{j}]") for j, o in enumerate(obj)]
        return [type(obj)(p[i] for p in split) for i in range(parts)]
    if isinstance(obj, dict):
        split = {k: split_micro_batches(v, total, parts, f"{what}[{k!r}]") for k, v in obj.items()}
        return [{k: split[k][i] for k in obj} for i in range(parts)]
    return [obj] * parts  # non-tensor values (flags) go to every part


def _constant(value: Any) -> Any:
    """Constants arrive as JSON lists; sizes were tuples in the model."""
    if isinstance(value, list):
        return tuple(_constant(v) for v in value)
    return value


@dataclass
class StepStats:
    step: int
    time_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    recv_wait_s: float = 0.0
    send_wait_s: float = 0.0
    reduce_s: float = 0.0
    optimizer_s: float = 0.0
    loss: Optional[float] = None  # mean over the micro-batches whose loss this rank computed
    loss_count: int = 0


@dataclass
class _State:
    """One micro-batch on one chunk."""

    inputs: List[Any] = field(default_factory=list)
    received: List[Any] = field(default_factory=list)
    outputs: Any = None
    grads: List[torch.Tensor] = field(default_factory=list)
    loss: Optional[torch.Tensor] = None
    target: Any = None
    saved_bytes: int = 0  # held for backward by this micro-batch's forward


class _ChunkRunner:
    """Per-chunk bookkeeping: which sent/received values are tensors and which carry gradients."""

    def __init__(self, chunk: Chunk):
        self.chunk = chunk
        self.send_tensors = [i for i, v in enumerate(chunk.send) if v["kind"] == "tensor"]
        self.send_grads = [i for i in self.send_tensors if chunk.send[i].get("requires_grad")]
        self.recv_tensors = [i for i, v in enumerate(chunk.recv) if v["kind"] == "tensor"]
        self.recv_grads = [i for i in self.recv_tensors if chunk.recv[i].get("requires_grad")]
        self.wanted_inputs = [chunk.model_inputs.index(n) for n in chunk.io.inputs]


TraceHook = Callable[[str, int, int, float, float], None]  # (kind, micro-batch, chunk, start, end)


class Engine:
    def __init__(self, rank_model: RankModel, actions: List[sched.Action], topology: Topology, rank: int,
                 global_batch: int, num_micro_batches: int, optimizer: Any, device: torch.device,
                 comm: Optional[PointToPoint], groups: "Groups", trace: Optional[TraceHook] = None,
                 recv_ahead: int = 2):
        self.spec = rank_model.spec
        self.rank_model = rank_model
        self.runners = {c.index: _ChunkRunner(c) for c in rank_model.chunks}
        self.actions = actions
        self.topology = topology
        self.replica = topology.replica_of(rank)
        self.global_batch = global_batch
        self.m = num_micro_batches
        self.optimizer = optimizer
        self.device = device
        self.comm = comm
        self.groups = groups
        self.trace = trace
        self.params = rank_model.parameters()
        self.saved = SavedBytes(self.params)
        # Saved-tensor hooks cost a Python call per saved tensor in forward and in backward (5-10 %
        # of a step of small ops; the profile times units without them). Every step holds the same
        # tensors, so the first step this engine runs counts them and the later ones run bare.
        self.count_saved = True
        # Receives posted ahead, in action order. Only where messages are matched by tag (gloo):
        # NCCL runs a pair's sends and receives in issue order on one stream, so a receive posted
        # early could sit in front of the send its sender is waiting for.
        self.recv_ahead = recv_ahead if comm is not None and comm.use_tags else 0
        self.receive_actions = [k for k, a in enumerate(actions) if a.kind in (sched.RECV_ACT, sched.RECV_GRAD)]

    def _peer(self, chunk: int, micro_batch: int) -> int:
        """The global rank running `micro_batch` through `chunk` in this data-parallel replica."""
        return self.topology.global_rank(self.replica, self.topology.position_of(chunk, micro_batch))

    # --- one step ---------------------------------------------------------------------------
    def _micro_batches(self, step: int) -> Tuple[List[Any], List[Any]]:
        inputs, target = self.spec.batch(self.global_batch, step)
        if not isinstance(inputs, (tuple, list)):
            raise BatchError("batch() must return (inputs: tuple, target); inputs was not a tuple")
        d = self.topology.data_parallel
        flat = self.rank_model.input_values(inputs)  # aligned with the graph's placeholders
        mine = split_micro_batches([flat, target], self.global_batch, d, "batch")[self.replica]
        per_replica = self.global_batch // d
        micro_inputs = split_micro_batches(mine[0], per_replica, self.m, "inputs")
        micro_targets = split_micro_batches(mine[1], per_replica, self.m, "target")
        return micro_inputs, micro_targets

    def run_step(self, step: int) -> StepStats:
        start = time.perf_counter()
        stats = StepStats(step=step)
        micro_inputs, micro_targets = self._micro_batches(step)
        states: Dict[Tuple[int, int], _State] = {}
        losses: List[float] = []
        receives = _ReceivesAhead(self.receive_actions, self.recv_ahead,
                                  lambda k: self.comm.post_recv(*self.message_of(self.actions[k])))
        for index, action in enumerate(self.actions):
            kind, i, g = action.kind, action.micro_batch, action.chunk
            t0 = time.perf_counter()
            if kind == sched.RECV_ACT:
                tensors = self.comm.recv(*self.message_of(action), posted=receives.take(index))
                states.setdefault((g, i), _State()).received = self._assemble(self.runners[g].chunk, tensors)
                stats.recv_wait_s += time.perf_counter() - t0
            elif kind == sched.FORWARD:
                state = states.setdefault((g, i), _State())
                self._forward(self.runners[g], state, micro_inputs[i], micro_targets[i])
                if state.loss is not None:
                    losses.append(float(state.loss.detach()) * self.m * self.topology.data_parallel)
                stats.forward_s += time.perf_counter() - t0
            elif kind == sched.SEND_ACT:
                runner, outputs = self.runners[g], states[(g, i)].outputs
                self.comm.send([outputs[j] for j in runner.send_tensors], self._peer(g + 1, i),
                               self._tag(g + 1, i), ACTIVATION)
            elif kind == sched.RECV_GRAD:
                states[(g, i)].grads = self.comm.recv(*self.message_of(action), posted=receives.take(index))
                stats.recv_wait_s += time.perf_counter() - t0
            elif kind == sched.BACKWARD:
                self._backward(self.runners[g], states[(g, i)])
                stats.backward_s += time.perf_counter() - t0
                if g == 0:  # nothing to send back: free the micro-batch now
                    states.pop((g, i), None)
            elif kind == sched.SEND_GRAD:
                runner, received = self.runners[g], states.pop((g, i)).received
                grads = [received[j].grad if received[j].grad is not None else torch.zeros_like(received[j])
                         for j in runner.recv_grads]
                self.comm.send(grads, self._peer(g - 1, i), self._tag(g - 1, i), GRADIENT)
            elif kind == sched.OPTIMIZER_STEP:
                if self.comm is not None:
                    self.comm.wait_sends()
                stats.send_wait_s += time.perf_counter() - t0
                t1 = time.perf_counter()
                self.groups.reduce_gradients(self.rank_model, self.params)
                t2 = time.perf_counter()
                stats.reduce_s += t2 - t1
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                stats.optimizer_s += time.perf_counter() - t2
            else:
                raise ValueError(f"unknown action {action}")
            if self.trace is not None:
                self.trace(kind, i, g, t0, time.perf_counter())
        self.count_saved = False
        if losses:
            stats.loss = sum(losses) / len(losses)
            stats.loss_count = len(losses)
        stats.time_s = time.perf_counter() - start
        return stats

    def message_of(self, action: sched.Action) -> Tuple[List[dict], int, int, int]:
        """(tensor specs, source rank, tag, direction) of the message a receive action waits for."""
        runner, i, g = self.runners[action.chunk], action.micro_batch, action.chunk
        if action.kind == sched.RECV_ACT:
            return [runner.chunk.recv[j] for j in runner.recv_tensors], self._peer(g - 1, i), self._tag(g, i), ACTIVATION
        return [runner.chunk.send[j] for j in runner.send_grads], self._peer(g + 1, i), self._tag(g, i), GRADIENT

    def _tag(self, receiving_chunk: int, micro_batch: int) -> int:
        """A message tag unique per (receiving chunk, micro-batch) within a step."""
        return receiving_chunk * self.m + micro_batch

    def _assemble(self, chunk: Chunk, tensors: List[torch.Tensor]) -> List[Any]:
        """Received tensors and injected constants, in the chunk's input order."""
        values: List[Any] = []
        it = iter(tensors)
        for spec in chunk.recv:
            if spec["kind"] == "tensor":
                t = next(it)
                if spec.get("requires_grad"):
                    t.requires_grad_(True)
                values.append(t)
            else:
                values.append(_constant(spec["value"]))
        return values

    def _forward(self, runner: _ChunkRunner, state: _State, inputs: List[Any], target: Any) -> None:
        chunk = runner.chunk
        args = to_device([inputs[j] for j in runner.wanted_inputs], self.device)
        with self.saved.counting() if self.count_saved else contextlib.nullcontext():
            out = chunk.module(*args, *state.received)
            if chunk.is_last:
                state.loss = self.spec.loss(out, to_device(target, self.device)) / (self.m * self.topology.data_parallel)
            else:
                state.outputs = out
        state.saved_bytes = self.saved.finish() if self.count_saved else 0

    def _backward(self, runner: _ChunkRunner, state: _State) -> None:
        if runner.chunk.is_last:
            state.loss.backward()
            state.loss = None
        else:
            pairs = [(state.outputs[j], g) for j, g in zip(runner.send_grads, state.grads)
                     if isinstance(state.outputs[j], torch.Tensor) and state.outputs[j].requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            state.outputs, state.grads = None, []
        self.saved.release(state.saved_bytes)


class _ReceivesAhead:
    """One step's receives, each posted `ahead` receive actions before it runs (in action order),
    so its data can move while this rank computes. `post(k)` posts action k's receive;
    `take(k)` hands over what was posted for it (None when nothing was posted ahead: the action
    posts and waits itself)."""

    def __init__(self, order: Sequence[int], ahead: int, post: Callable[[int], PostedRecv]):
        self.order, self.ahead, self.post = list(order), ahead, post
        self.rank_in_order = {k: n for n, k in enumerate(self.order)}
        self.posted: Dict[int, PostedRecv] = {}
        self.next = 0  # index into `order` of the next receive to post
        self._top_up(0)

    def _top_up(self, consumed: int) -> None:
        while self.next < len(self.order) and self.next < consumed + self.ahead:
            k = self.order[self.next]
            self.posted[k] = self.post(k)
            self.next += 1

    def take(self, action_index: int) -> Optional[PostedRecv]:
        if not self.ahead:
            return None
        posted = self.posted.pop(action_index)
        self._top_up(self.rank_in_order[action_index] + 1)
        return posted


class Groups:
    """Process groups for gradient reductions, created by every rank in the same order, as
    torch.distributed requires:

    - holders of the same chunks (a stage's replicas across data-parallel replicas and within
      the pipeline): their gradients are summed in one flat all-reduce;
    - tied weights used by chunks on several positions: one group of every rank holding a use,
      in every replica, whose sum is the whole gradient (so tied parameters skip the first).
    """

    def __init__(self, topology: Topology, rank: int, tied_groups: List[Tuple[str, Tuple[int, ...]]]):
        self.topology = topology
        self.tie_groups: Dict[str, Any] = {}
        self.data_parallel_group = None  # the holders of this rank's chunks, when more than one
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
