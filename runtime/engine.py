"""Execute one rank's instruction list, step after step.

A step: `inputs, target = batch(G, step)`; replica r of d takes samples [r·G/d, (r+1)·G/d) and
splits them into m equal micro-batches along dim 0. The last stage's loss for micro-batch i is
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
from planner.pipeline.schedule import Action, ActionKind
from planner.pipeline.topology import Topology
from planner.profile.saved import SavedBytes
from runtime.comm import ACTIVATION, GRADIENT, PointToPoint, PostedRecv
from runtime.stage import RankModel, RankStage


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
    """One micro-batch on one stage."""

    received: List[Any] = field(default_factory=list)
    outputs: Any = None
    grads: List[torch.Tensor] = field(default_factory=list)
    loss: Optional[torch.Tensor] = None
    saved_bytes: int = 0  # held for backward by this micro-batch's forward


class _StageRunner:
    """Per-stage bookkeeping: which sent/received values are tensors and which carry gradients."""

    def __init__(self, stage: RankStage):
        self.stage = stage
        self.send_tensors = [i for i, v in enumerate(stage.send) if v["kind"] == "tensor"]
        self.send_grads = [i for i in self.send_tensors if stage.send[i].get("requires_grad")]
        self.recv_tensors = [i for i, v in enumerate(stage.recv) if v["kind"] == "tensor"]
        self.recv_grads = [i for i in self.recv_tensors if stage.recv[i].get("requires_grad")]
        self.wanted_inputs = [stage.model_inputs.index(n) for n in stage.io.inputs]


@dataclass
class _Step:
    """What one step's actions share: its micro-batches, the micro-batches in flight, the timings."""

    stats: StepStats
    inputs: List[Any]  # per micro-batch, aligned with the graph's placeholders
    targets: List[Any]
    receives: "_ReceivesAhead"
    states: Dict[Tuple[int, int], _State] = field(default_factory=dict)  # (stage, micro-batch) -> state
    losses: List[float] = field(default_factory=list)


TraceHook = Callable[[str, int, int, float, float], None]  # (kind, micro-batch, stage, start, end)


class Engine:
    """Runs one rank's instruction list, step after step: each action by its kind's handler."""

    def __init__(self, rank_model: RankModel, actions: List[Action], topology: Topology, rank: int,
                 global_batch: int, num_micro_batches: int, optimizer: Any, device: torch.device,
                 comm: Optional[PointToPoint], groups: "Groups", trace: Optional[TraceHook] = None,
                 recv_ahead: int = 2):
        self.spec = rank_model.spec
        self.rank_model = rank_model
        self.runners = {st.index: _StageRunner(st) for st in rank_model.stages}
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
        # Saved-tensor hooks cost a Python call per saved tensor in forward and in backward (the
        # profile times units without them). Every step holds the same tensors, so the first step
        # this engine runs counts them and the later ones run bare.
        self.count_saved = True
        # Receives posted ahead, in action order. Only where messages are matched by tag (gloo):
        # NCCL runs a pair's sends and receives in issue order on one stream, so a receive posted
        # early could sit in front of the send its sender is waiting for.
        self.recv_ahead = recv_ahead if comm is not None and comm.use_tags else 0
        self.receive_actions = [k for k, a in enumerate(actions)
                                if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)]
        self.handlers: Dict[ActionKind, Callable[[_Step, int, Action], None]] = {
            ActionKind.RECV_ACT: self._receive_activations, ActionKind.FORWARD: self._forward,
            ActionKind.SEND_ACT: self._send_activations, ActionKind.RECV_GRAD: self._receive_gradients,
            ActionKind.BACKWARD: self._backward, ActionKind.SEND_GRAD: self._send_gradients,
            ActionKind.OPTIMIZER_STEP: self._optimizer_step}

    def _peer(self, stage: int, micro_batch: int) -> int:
        """The global rank running `micro_batch` through `stage` in this data-parallel replica."""
        return self.topology.global_rank(self.replica, self.topology.rank_running(stage, micro_batch))

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
        micro_inputs, micro_targets = self._micro_batches(step)
        receives = _ReceivesAhead(self.receive_actions, self.recv_ahead,
                                  lambda k: self.comm.post_recv(*self.message_of(self.actions[k])))
        current = _Step(StepStats(step=step), micro_inputs, micro_targets, receives)
        for index, action in enumerate(self.actions):
            t0 = time.perf_counter()
            self.handlers[action.kind](current, index, action)
            if self.trace is not None:
                self.trace(action.kind.value, action.micro_batch, action.stage, t0, time.perf_counter())
        self.count_saved = False
        stats = current.stats
        if current.losses:
            stats.loss = sum(current.losses) / len(current.losses)
            stats.loss_count = len(current.losses)
        stats.time_s = time.perf_counter() - start
        return stats

    # --- the handlers, one per action kind -------------------------------------------------------
    def _receive_activations(self, step: _Step, index: int, action: Action) -> None:
        t0 = time.perf_counter()
        g, i = action.stage, action.micro_batch
        tensors = self.comm.recv(*self.message_of(action), posted=step.receives.take(index))
        step.states.setdefault((g, i), _State()).received = self._assemble(self.runners[g].stage, tensors)
        step.stats.recv_wait_s += time.perf_counter() - t0

    def _forward(self, step: _Step, index: int, action: Action) -> None:
        t0 = time.perf_counter()
        g, i = action.stage, action.micro_batch
        runner, state = self.runners[g], step.states.setdefault((g, i), _State())
        args = to_device([step.inputs[i][j] for j in runner.wanted_inputs], self.device)
        with self.saved.counting() if self.count_saved else contextlib.nullcontext():
            out = runner.stage.module(*args, *state.received)
            if runner.stage.is_last:
                state.loss = self.spec.loss(out, to_device(step.targets[i], self.device)) / \
                    (self.m * self.topology.data_parallel)
            else:
                state.outputs = out
        state.saved_bytes = self.saved.finish() if self.count_saved else 0
        if state.loss is not None:
            step.losses.append(float(state.loss.detach()) * self.m * self.topology.data_parallel)
        step.stats.forward_s += time.perf_counter() - t0

    def _send_activations(self, step: _Step, index: int, action: Action) -> None:
        g, i = action.stage, action.micro_batch
        runner, outputs = self.runners[g], step.states[(g, i)].outputs
        self.comm.send([outputs[j] for j in runner.send_tensors], self._peer(g + 1, i), self._tag(g + 1, i),
                       ACTIVATION)

    def _receive_gradients(self, step: _Step, index: int, action: Action) -> None:
        t0 = time.perf_counter()
        state = step.states[(action.stage, action.micro_batch)]
        state.grads = self.comm.recv(*self.message_of(action), posted=step.receives.take(index))
        step.stats.recv_wait_s += time.perf_counter() - t0

    def _backward(self, step: _Step, index: int, action: Action) -> None:
        t0 = time.perf_counter()
        g, i = action.stage, action.micro_batch
        runner, state = self.runners[g], step.states[(g, i)]
        if runner.stage.is_last:
            state.loss.backward()
            state.loss = None
        else:
            pairs = [(state.outputs[j], grad) for j, grad in zip(runner.send_grads, state.grads)
                     if isinstance(state.outputs[j], torch.Tensor) and state.outputs[j].requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [grad for _, grad in pairs])
            state.outputs, state.grads = None, []
        self.saved.release(state.saved_bytes)
        step.stats.backward_s += time.perf_counter() - t0
        if g == 0:  # nothing to send back: free the micro-batch now
            step.states.pop((g, i), None)

    def _send_gradients(self, step: _Step, index: int, action: Action) -> None:
        g, i = action.stage, action.micro_batch
        runner, received = self.runners[g], step.states.pop((g, i)).received
        grads = [received[j].grad if received[j].grad is not None else torch.zeros_like(received[j])
                 for j in runner.recv_grads]
        self.comm.send(grads, self._peer(g - 1, i), self._tag(g - 1, i), GRADIENT)

    def _optimizer_step(self, step: _Step, index: int, action: Action) -> None:
        t0 = time.perf_counter()
        if self.comm is not None:
            self.comm.wait_sends()
        t1 = time.perf_counter()
        step.stats.send_wait_s += t1 - t0
        # issue 25: a gradient-sharded optimizer reduces the data-parallel gradients itself (runtime/shard.py)
        sharded = getattr(self.optimizer, "reduces_gradients", False)
        self.groups.reduce_gradients(self.rank_model, [] if sharded else self.params)
        t2 = time.perf_counter()
        step.stats.reduce_s += t2 - t1
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        step.stats.optimizer_s += time.perf_counter() - t2

    def message_of(self, action: Action) -> Tuple[List[dict], int, int, int]:
        """(tensor specs, source rank, tag, direction) of the message a receive action waits for."""
        runner, i, g = self.runners[action.stage], action.micro_batch, action.stage
        if action.kind is ActionKind.RECV_ACT:
            return [runner.stage.recv[j] for j in runner.recv_tensors], self._peer(g - 1, i), self._tag(g, i), ACTIVATION
        return [runner.stage.send[j] for j in runner.send_grads], self._peer(g + 1, i), self._tag(g, i), GRADIENT

    def _tag(self, receiving_stage: int, micro_batch: int) -> int:
        """A message tag unique per (receiving stage, micro-batch) within a step."""
        return receiving_stage * self.m + micro_batch

    def _assemble(self, stage: RankStage, tensors: List[torch.Tensor]) -> List[Any]:
        """Received tensors and injected constants, in the stage's input order."""
        values: List[Any] = []
        it = iter(tensors)
        for spec in stage.recv:
            if spec["kind"] == "tensor":
                t = next(it)
                if spec.get("requires_grad"):
                    t.requires_grad_(True)
                values.append(t)
            else:
                values.append(_constant(spec["value"]))
        return values


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
