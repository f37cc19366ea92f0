"""Execute one rank's instruction list, step after step.

A step: `inputs, target = batch(G, step)`; replica r of d takes samples [r·G/d, (r+1)·G/d) and
splits them into m equal micro-batches along dim 0 (each a tensor of its own, not a view of the
batch). The last stage's loss for micro-batch i is `loss(output_i, target_i) / (d·m)`, so after
the gradient all-reduce (a sum over replicas) every parameter holds the gradient of the mean
micro-batch loss, exactly as single-device gradient accumulation over the same d·m micro-batches
computes it. A replicated stage's replicas each run their share of the micro-batches
(round-robin) and sum gradients the same way. Tied weights used on several ranks get their
gradients summed across all their holders. One optimizer step per rank ends the step.

Communication runs in batches (runtime.program): a batch's sends and receives are posted together
and waited for entirely before the next action. Stages on the same rank hand values over in
memory: the forward of stage g + 1 takes stage g's outputs of that micro-batch (as leaves sharing
their storage), the backward of stage g takes the gradients stage g + 1's backward left on them.

What the engine holds per micro-batch in flight on a stage (the memory the plan models):
- from its forward to its backward, what autograd saved for backward (each storage once,
  parameters excluded: "live");
- a received activation from its receive until its forward ("inbox") and a received gradient from
  its receive until its backward ("gradbox");
- nothing else of size: a sent message's buffer is freed when its batch completes; the stage's
  outputs and received inputs stay only as autograd endpoints, their storage dropped (replaced by
  a zero-stride view of one element, Megatron's deallocate_output_tensor idea) unless autograd
  saved that storage for backward, in which case it is already counted as live; outputs handed to
  a stage on the same rank are dropped once that stage's forward has used them; the gradient of a
  stage's inputs lives from its backward until its send's batch completes (or the previous stage's
  backward on this rank takes it). Stages with recomputed units keep their inputs and outputs
  (recomputation reads them again).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from planner.pipeline.actions import Action, ActionKind
from planner.pipeline.topology import Topology
from planner.profile.saved import SavedBytes
from runtime.comm import ACTIVATION, GRADIENT, MessageLayout, Operation, exchange, message_tag, torch_dtype
from runtime.groups import Groups
from runtime.program import COMMUNICATION, batches
from runtime.stage import RankModel, RankStage
from runtime.timing import StepClock


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


def _own(obj: Any, device: torch.device) -> Any:
    """`obj` on `device` with every tensor in storage of its own (a micro-batch that is a view of
    the whole batch would keep the whole batch alive, and be counted so, while saved for backward)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_own(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _own(v, device) for k, v in obj.items()}
    return obj


def _constant(value: Any) -> Any:
    """Constants arrive as JSON lists; sizes were tuples in the model."""
    if isinstance(value, list):
        return tuple(_constant(v) for v in value)
    return value


def _drop_storage(tensor: torch.Tensor) -> None:
    """Keep `tensor` as an autograd endpoint (its shape, dtype and graph) without its data."""
    tensor.data = torch.zeros((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


@dataclass
class StepStats:
    step: int
    time_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0  # in batches of messages: posting, transfer and waiting for the peers
    reduce_s: float = 0.0
    optimizer_s: float = 0.0
    messages: int = 0  # point-to-point operations this rank posted
    loss: Optional[float] = None  # mean over the micro-batches whose loss this rank computed
    loss_count: int = 0


@dataclass
class _State:
    """One micro-batch on one stage."""

    received: List[Any] = field(default_factory=list)  # the stage's inputs from the previous stage
    outputs: Any = None  # what it sends on (a tuple), until its backward
    grads: List[torch.Tensor] = field(default_factory=list)  # gradients of those outputs, until backward
    input_grads: List[torch.Tensor] = field(default_factory=list)  # of the inputs, until sent or taken
    loss: Optional[torch.Tensor] = None
    saved_bytes: int = 0  # held for backward by this micro-batch's forward


class _StageRunner:
    """Per-stage bookkeeping: which values are tensors, which carry gradients, the messages' layouts,
    and which storages autograd keeps (learned in the first step's forward)."""

    def __init__(self, stage: RankStage):
        self.stage = stage
        self.send_tensors = [i for i, v in enumerate(stage.send) if v["kind"] == "tensor"]
        self.send_grads = [i for i in self.send_tensors if stage.send[i].get("requires_grad")]
        self.recv_tensors = [i for i, v in enumerate(stage.recv) if v["kind"] == "tensor"]
        self.recv_grads = [i for i in self.recv_tensors if stage.recv[i].get("requires_grad")]
        self.wanted_inputs = [stage.model_inputs.index(n) for n in stage.io.inputs]

        def layout(values, indices, what):
            return MessageLayout([(tuple(values[j]["shape"]), torch_dtype(values[j]["dtype"])) for j in indices], what)

        g = stage.index
        self.act_in = layout(stage.recv, self.recv_tensors, f"stage {g}'s input")
        self.act_out = layout(stage.send, self.send_tensors, f"stage {g}'s output")
        self.grad_in = layout(stage.send, self.send_grads, f"the gradient of stage {g}'s output")
        self.grad_out = layout(stage.recv, self.recv_grads, f"the gradient of stage {g}'s input")
        # Positions (in `send_tensors` / `recv_tensors` order) whose storage autograd saved; None
        # until learned. A stage with recomputed units reads its inputs again in backward: keep all.
        self.kept_outputs: Optional[Set[int]] = None
        self.kept_inputs: Optional[Set[int]] = None
        self.droppable = not stage.recompute


@dataclass
class _Step:
    """What one step's actions share: its micro-batches, the micro-batches in flight, the timings."""

    stats: StepStats
    inputs: List[Any]  # per micro-batch, aligned with the graph's placeholders
    targets: List[Any]
    states: Dict[Tuple[int, int], _State] = field(default_factory=dict)  # (stage, micro-batch) -> state
    loss_sum: Optional[torch.Tensor] = None  # on the device: one read per step
    loss_count: int = 0


TraceHook = Callable[[str, int, int, float, float], None]  # (kind, micro-batch, stage, start, end)


class Engine:
    """Runs one rank's instruction list, step after step: each compute action by its kind's
    handler, each batch of communication actions posted together."""

    def __init__(self, rank_model: RankModel, actions: List[Action], topology: Topology, rank: int,
                 global_batch: int, num_micro_batches: int, optimizer: Any, device: torch.device,
                 groups: Groups, use_tags: bool = True, trace: Optional[TraceHook] = None,
                 autocast: Optional[torch.dtype] = None):
        self.spec = rank_model.spec
        self.rank_model = rank_model
        self.runners = {st.index: _StageRunner(st) for st in rank_model.stages}
        self.actions = actions
        self.program = batches(actions)
        self.topology = topology
        self.replica = topology.replica_of(rank)
        self.pipeline_rank = topology.pipeline_rank_of(rank)
        self.global_batch = global_batch
        self.m = num_micro_batches
        self.optimizer = optimizer
        self.device = device
        self.use_tags = use_tags  # gloo matches messages by tag; NCCL by order
        self.groups = groups
        self.trace = trace
        self.autocast = autocast
        self.clock = StepClock(device)
        self.params = rank_model.parameters()
        self.saved = SavedBytes(self.params)
        # Saved-tensor hooks cost a Python call per saved tensor in forward and in backward (the
        # profile times units without them). Every step holds the same tensors, so the first step
        # this engine runs counts them and the later ones run bare.
        self.count_saved = True
        self.before_optimizer: List[Callable[[], None]] = []  # e.g. gradient clipping
        self.handlers: Dict[ActionKind, Callable[[_Step, Action], None]] = {
            ActionKind.FORWARD: self._forward, ActionKind.BACKWARD: self._backward,
            ActionKind.OPTIMIZER_STEP: self._optimizer_step}
        # communication: (operation to post, what to do with the received buffer once the batch is done)
        self.messages: Dict[ActionKind, Callable[[_Step, Action], Tuple[Operation, Optional[Callable]]]] = {
            ActionKind.SEND_ACT: self._send_activations, ActionKind.RECV_ACT: self._receive_activations,
            ActionKind.SEND_GRAD: self._send_gradients, ActionKind.RECV_GRAD: self._receive_gradients}

    def _peer(self, stage: int, micro_batch: int) -> int:
        """The global rank running `micro_batch` through `stage` in this data-parallel replica."""
        return self.topology.global_rank(self.replica, self.topology.rank_running(stage, micro_batch))

    def _here(self, stage: int, micro_batch: int) -> bool:
        return stage in self.runners and self.topology.rank_running(stage, micro_batch) == self.pipeline_rank

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
        micro_inputs, micro_targets = self._micro_batches(step)
        current = _Step(StepStats(step=step), micro_inputs, micro_targets)
        clock = self.clock
        clock.start()
        for group in self.program:
            first = self.actions[group[0]]
            clock.mark()
            if first.kind in COMMUNICATION:
                batch = [self.actions[k] for k in group]
                self._run_batch(current, batch)
                clock.stop("wait_s", batch)
            else:
                self.handlers[first.kind](current, first)
                key = {ActionKind.FORWARD: "forward_s", ActionKind.BACKWARD: "backward_s"}.get(first.kind)
                clock.stop(key or "optimizer_s", first)
        totals, spans, step_s = clock.finish()
        self.count_saved = False
        stats = current.stats
        for key, seconds in totals.items():
            setattr(stats, key, getattr(stats, key) + seconds)
        stats.time_s = step_s
        if self.trace is not None:
            for label, t0, t1 in spans:  # an action, a batch's actions (one span), or a name
                for action in (label if isinstance(label, list) else [label]):
                    if isinstance(action, Action):
                        self.trace(action.kind.value, action.micro_batch, action.stage, t0, t1)
                    else:
                        self.trace(action, -1, -1, t0, t1)
        if current.loss_count:
            stats.loss = float(current.loss_sum) / current.loss_count
            stats.loss_count = current.loss_count
        return stats

    # --- compute ----------------------------------------------------------------------------
    def _forward(self, step: _Step, action: Action) -> None:
        g, i = action.stage, action.micro_batch
        runner, state = self.runners[g], step.states.setdefault((g, i), _State())
        if g > 0 and self._here(g - 1, i):  # handed over in memory by the previous stage
            before = step.states[(g - 1, i)]
            state.received = self._assemble(runner.stage, [before.outputs[j].detach() for j in
                                                           self.runners[g - 1].send_tensors])
        args = _own([step.inputs[i][j] for j in runner.wanted_inputs], self.device)
        counting = self.count_saved
        with self.saved.counting() if counting else contextlib.nullcontext(), self._autocast():
            out = runner.stage.module(*args, *state.received)
            if runner.stage.is_last:
                loss = self.spec.loss(out, _own(step.targets[i], self.device))
                state.loss = loss / (self.m * self.topology.data_parallel)
            else:
                state.outputs = out
        if counting:
            saved = self.saved.saved_storages()
            state.saved_bytes = self.saved.finish()
            self._learn_kept(runner, state, saved)
        if state.loss is not None:
            detached = state.loss.detach().float() * (self.m * self.topology.data_parallel)
            step.loss_sum = detached if step.loss_sum is None else step.loss_sum + detached
            step.loss_count += 1
        self._drop_inputs(runner, state)
        if g > 0 and self._here(g - 1, i):
            self._drop_outputs(self.runners[g - 1], step.states[(g - 1, i)])

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _learn_kept(self, runner: _StageRunner, state: _State, saved: Set[int]) -> None:
        def kept(values, indices):
            return {n for n, j in enumerate(indices) if isinstance(values[j], torch.Tensor)
                    and values[j].untyped_storage().data_ptr() in saved}

        if runner.kept_inputs is None:
            runner.kept_inputs = kept(state.received, runner.recv_tensors) if state.received else set()
        if runner.kept_outputs is None and state.outputs is not None:
            runner.kept_outputs = kept(state.outputs, runner.send_tensors)

    def _drop_inputs(self, runner: _StageRunner, state: _State) -> None:
        """After the forward: received values autograd did not save are kept only as the leaves
        whose .grad the backward fills (without data), or not at all."""
        if not runner.droppable or runner.kept_inputs is None or not state.received:
            return
        # an input passed on as an output is sent after this: its data stays until then
        passed_on = {o.untyped_storage().data_ptr() for o in (state.outputs or ()) if isinstance(o, torch.Tensor)}
        for n, j in enumerate(runner.recv_tensors):
            value = state.received[j]
            if n in runner.kept_inputs or value.untyped_storage().data_ptr() in passed_on:
                continue
            if value.requires_grad:
                _drop_storage(value)
            else:
                state.received[j] = None

    def _drop_outputs(self, runner: _StageRunner, state: _State) -> None:
        """After the outputs were sent (or handed over): keep only what the backward needs."""
        if not runner.droppable or runner.kept_outputs is None or state.outputs is None:
            return
        outputs = list(state.outputs)
        for n, j in enumerate(runner.send_tensors):
            value = outputs[j]
            if n in runner.kept_outputs:
                continue
            if value.requires_grad and value.grad_fn is not None:
                _drop_storage(value)
            elif not value.requires_grad:
                outputs[j] = None
        state.outputs = outputs

    def _backward(self, step: _Step, action: Action) -> None:
        g, i = action.stage, action.micro_batch
        runner, state = self.runners[g], step.states[(g, i)]
        if runner.stage.is_last:
            state.loss.backward()
            state.loss = None
        else:
            if self._here(g + 1, i):  # the next stage's backward left them here
                state.grads = step.states.pop((g + 1, i)).input_grads
            pairs = [(state.outputs[j], grad) for j, grad in zip(runner.send_grads, state.grads)
                     if isinstance(state.outputs[j], torch.Tensor) and state.outputs[j].requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [grad for _, grad in pairs])
            state.outputs, state.grads = None, []
        self.saved.release(state.saved_bytes)
        if g == 0:  # nothing to send back: the micro-batch is done here
            step.states.pop((g, i), None)
            return
        shapes = runner.grad_out.tensors
        state.input_grads = [state.received[j].grad if state.received[j].grad is not None
                             else torch.zeros(shape, dtype=dtype, device=self.device)
                             for j, (shape, dtype) in zip(runner.recv_grads, shapes)]
        state.received = []

    # --- communication ---------------------------------------------------------------------------
    def _run_batch(self, step: _Step, actions: List[Action]) -> None:
        """Post the batch's operations together, wait for all, then use what arrived."""
        operations, after = [], []
        for action in actions:
            operation, done = self.messages[action.kind](step, action)
            operations.append(operation)
            after.append(done)
        exchange(operations, self.use_tags)
        step.stats.messages += len(operations)
        for done, operation in zip(after, operations):
            if done is not None:
                done(operation.tensor)

    def _tag(self, receiving_stage: int, micro_batch: int, direction: int) -> int:
        return message_tag(receiving_stage, micro_batch, direction, self.m)

    def _send_activations(self, step: _Step, action: Action):
        g, i = action.stage, action.micro_batch
        runner, state = self.runners[g], step.states[(g, i)]
        wire = runner.act_out.pack([state.outputs[j] for j in runner.send_tensors], self.device)
        return (Operation(True, wire, self._peer(g + 1, i), self._tag(g + 1, i, ACTIVATION)),
                lambda _: self._drop_outputs(runner, state))

    def _receive_activations(self, step: _Step, action: Action):
        g, i = action.stage, action.micro_batch
        runner = self.runners[g]

        def arrived(wire: torch.Tensor) -> None:
            step.states.setdefault((g, i), _State()).received = self._assemble(runner.stage,
                                                                               runner.act_in.unpack(wire))

        return Operation(False, runner.act_in.empty(self.device), self._peer(g - 1, i),
                         self._tag(g, i, ACTIVATION)), arrived

    def _send_gradients(self, step: _Step, action: Action):
        g, i = action.stage, action.micro_batch
        runner, state = self.runners[g], step.states.pop((g, i))
        wire = runner.grad_out.pack(state.input_grads, self.device)
        return Operation(True, wire, self._peer(g - 1, i), self._tag(g - 1, i, GRADIENT)), None

    def _receive_gradients(self, step: _Step, action: Action):
        g, i = action.stage, action.micro_batch
        runner, state = self.runners[g], step.states[(g, i)]

        def arrived(wire: torch.Tensor) -> None:
            state.grads = runner.grad_in.unpack(wire)

        return Operation(False, runner.grad_in.empty(self.device), self._peer(g + 1, i),
                         self._tag(g, i, GRADIENT)), arrived

    # --- end of step ----------------------------------------------------------------------------
    def _optimizer_step(self, step: _Step, action: Action) -> None:
        # issue 25: a gradient-sharded optimizer reduces the data-parallel gradients itself (runtime/shard.py)
        sharded = getattr(self.optimizer, "reduces_gradients", False)
        self.groups.reduce_gradients(self.rank_model, [] if sharded else self.params)
        self.clock.stop("reduce_s", "reduce")
        self.clock.mark()
        for hook in self.before_optimizer:
            hook()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

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
