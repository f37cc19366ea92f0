"""Execute one rank's instruction list, step after step.

A step: `inputs, target = batch(G, step)`; replica r of d takes samples [r·G/d, (r+1)·G/d) and
splits them into m equal micro-batches along dim 0 (each a tensor of its own, not a view of the
batch). The last stage's loss for micro-batch i is `loss(output_i, target_i) / (d·m)`, so after
the gradient all-reduce (a sum over replicas) every parameter holds the gradient of the mean
micro-batch loss, exactly as single-device gradient accumulation over the same d·m micro-batches
computes it (under local SGD, plan `sync_every` H > 1, runtime.localsgd: `/ m`, no all-reduce, each
replica a trainer of its own, their models averaged every H steps). A replicated stage's replicas
each run their share of the micro-batches (round-robin) and sum gradients the same way. Tied
weights used on several ranks get their gradients summed across all their holders (under local
SGD, those of the replica). One optimizer step per rank ends the step.

Communication runs in batches (runtime.program): a batch's sends and receives are posted together
and waited for entirely before the next action, except a batch of sends only, which is waited for
before the rank's next batch or the end of its step (runtime.outbox). Stages on the same rank hand values over in
memory: the forward of stage g + 1 takes stage g's outputs of that micro-batch (as leaves sharing
their storage), the backward of stage g takes the gradients stage g + 1's backward left on them (laid out as
their message would be: runtime.comm.in_order); a view
of a larger storage goes over as a copy, as a message's tensors arrive (step_state.own_storages), not
pinning the rest of that storage.

What the engine holds per micro-batch in flight on a stage (the memory the plan models):
- from its forward to its backward, what autograd saved for backward (each storage once,
  parameters excluded: "live");
- a received activation from its receive until its forward ("inbox") and a received gradient from
  its receive until its backward ("gradbox");
- under zero-bubble schedules, from its input backward to its weight backward, what the weight gradients
  still read (the subgraph below the frontier, planner.profile.splitgrad, and the gradients kept there:
  "weight");
- nothing else of size: a sent message's buffer is freed when its send is waited for; the stage's
  outputs and received inputs stay only as autograd endpoints, their storage dropped (replaced by
  a zero-stride view of one element, Megatron's deallocate_output_tensor idea) unless autograd
  saved that storage for backward, in which case it is already counted as live; outputs handed to
  a stage on the same rank are dropped once that stage's forward has used them; the gradient of a
  stage's inputs lives from its backward until its send's batch completes (or the previous stage's
  backward on this rank takes it). Stages with recomputed units keep their inputs and outputs
  (recomputation reads them again).
Once per step, not per micro-batch: under bf16-mixed, the bf16 copy of the weights every forward and
backward of the step computes with (planner.model.precision), counted with the parameters, not as live.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from planner.pipeline.actions import Action, ActionKind
from planner.pipeline.topology import Topology
from planner.profile.saved import SavedBytes
from runtime.comm import MessageLayout, Operation, exchange, in_order, post
from runtime.emulation import hold, hold_exchange, transfer_delay
from runtime.groups import GradientBuckets, Groups, data_parallel_buckets, last_backwards
from runtime.localsgd import ModelAverager
from runtime.message_actions import MessageActions
from runtime.microbatch import assemble, replica_micro_batches
from runtime.outbox import Outbox, completed
from planner.model.precision import ComputeCopy
from planner.model.spec import loss_problem, to_device
from runtime.runner import StageRunner
from planner.profile.splitgrad import backward_input, backward_weight
from runtime.program import COMMUNICATION, batches
from runtime.stage import RankModel
from runtime.step_state import MicroBatchState, StepState, StepStats, own_storages
from runtime.timing import StepClock, close_step


TraceHook = Callable[[str, int, int, float, float], None]  # (kind, micro-batch, stage, start, end)


# the step clock's key for each compute action (others: the optimizer step)
_TIMER = {ActionKind.FORWARD: "forward_s", ActionKind.BACKWARD: "backward_s", ActionKind.BACKWARD_INPUT: "backward_s",
          ActionKind.BACKWARD_WEIGHT: "backward_s"}


class Engine(MessageActions):
    """Runs one rank's instruction list, step after step: each compute action by its kind's
    handler, each batch of communication actions posted together."""

    def __init__(self, rank_model: RankModel, actions: List[Action], topology: Topology, rank: int,
                 global_batch: int, num_micro_batches: int, optimizer: Any, device: torch.device,
                 groups: Groups, use_tags: bool = True, trace: Optional[TraceHook] = None,
                 autocast: Optional[torch.dtype] = None, sync_every: int = 1):
        self.spec = rank_model.spec
        self.rank_model = rank_model
        self.runners = {st.index: StageRunner(st) for st in rank_model.stages}
        # each stage's own parameters, taken before any step: under bf16-mixed the modules hold the
        # step's compute copies while it runs, and a split backward's weight part must reach the
        # fp32 masters through them (planner.model.precision)
        # the trainable ones, listed once (a split backward takes them so: planner.profile.splitgrad)
        self.stage_params = {st.index: [p for p in st.module.parameters() if p.requires_grad]
                             for st in rank_model.stages}
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
        self.local = None  # runtime.shared_memory: the peers of this host, on the CPU
        self.groups = groups
        self.trace = trace
        self.autocast = autocast  # torch.autocast's dtype for forwards and losses, or None
        # bf16-mixed: one compute copy of the weights per step, fp32 masters (planner.model.precision)
        self.compute_copy = (ComputeCopy([st.module for st in rank_model.stages], autocast)
                             if autocast is not None else None)
        self.layouts: Dict[Tuple, MessageLayout] = {}  # under autocast: each message's dtypes, once known
        # which tensors of a gradient message have a gradient, by (direction, stage, peer): said by the
        # pair's first message (comm.PresenceLayout)
        self.presence: Dict[Tuple, Optional[Tuple[bool, ...]]] = {}
        self.emulated_links: Dict[Tuple[str, int], float] = {}  # runtime.emulation: seconds per crossing
        self.emulated_exchange_s = 0.0  # runtime.emulation: seconds held after the data-parallel exchange
        self.clock = StepClock(device)
        self.outbox = Outbox()  # sends posted and not yet waited for
        self.params = rank_model.parameters()
        self.saved = SavedBytes(self.params)
        # Saved-tensor hooks cost a Python call per saved tensor in forward and in backward (the
        # profile times units without them). Every step holds the same tensors, so the first step
        # this engine runs counts them and the later ones run bare.
        self.count_saved = True
        # zero-bubble lists: between a micro-batch's two backward parts only part of what it saved is
        # held (what the weight gradients read, planner.profile.splitgrad), with the kept gradients
        self.split_backward = any(a.kind is ActionKind.BACKWARD_INPUT for a in self.actions)
        self.before_optimizer: List[Callable[[], None]] = []  # e.g. gradient clipping
        self.buckets: Optional[GradientBuckets] = None
        self.arming: Dict[Tuple[int, int], List[torch.nn.Parameter]] = {}  # last backward -> params it completes
        # local SGD (runtime.localsgd): each replica trains alone (loss / m) and the replicas average
        # their models every `sync_every` steps, with no gradient all-reduce
        self.averager: Optional[ModelAverager] = None
        self.trainers = topology.data_parallel  # the replicas one loss is shared by
        self._seeds: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}  # _loss_seed's, made once
        if sync_every > 1 and groups.data_parallel_group is not None:
            self.averager = ModelAverager(rank_model, groups.data_parallel_group, topology.data_parallel, sync_every)
            self.trainers = 1
        elif groups.data_parallel_group is not None and not getattr(optimizer, "reduces_gradients", False):
            self.buckets, tied = data_parallel_buckets(rank_model, groups.data_parallel_group)
            self.arming = last_backwards(self.actions, {g: r.stage for g, r in self.runners.items()}, tied)
        self.handlers: Dict[ActionKind, Callable[[StepState, Action], None]] = {
            ActionKind.FORWARD: self._forward, ActionKind.BACKWARD: self._backward,
            ActionKind.BACKWARD_INPUT: self._backward_input, ActionKind.BACKWARD_WEIGHT: self._backward_weight,
            ActionKind.OPTIMIZER_STEP: self._optimizer_step}
        # communication: (operation to post, what to do with the received buffer once the batch is done)
        self.messages: Dict[ActionKind, Callable[[StepState, Action], Tuple[Operation, Optional[Callable]]]] = {
            ActionKind.SEND_ACT: self._send_activations, ActionKind.RECV_ACT: self._receive_activations,
            ActionKind.SEND_GRAD: self._send_gradients, ActionKind.RECV_GRAD: self._receive_gradients}

    def _peer(self, stage: int, micro_batch: int) -> int:
        """The global rank running `micro_batch` through `stage` in this data-parallel replica."""
        return self.topology.global_rank(self.replica, self.topology.rank_running(stage, micro_batch))

    def _here(self, stage: int, micro_batch: int) -> bool:
        return stage in self.runners and self.topology.rank_running(stage, micro_batch) == self.pipeline_rank

    # --- one step ---------------------------------------------------------------------------
    def _micro_batches(self, step: int) -> Tuple[List[Any], List[Any]]:
        return replica_micro_batches(self.spec, self.rank_model, self.global_batch, self.topology.data_parallel,
                                     self.replica, self.m, step)

    def run_step(self, step: int) -> StepStats:
        micro_inputs, micro_targets = self._micro_batches(step)
        current = StepState(StepStats(step=step), micro_inputs, micro_targets)
        if self.buckets is not None:
            self.buckets.begin_step()
        clock = self.clock
        clock.start()
        if self.compute_copy is not None:
            self.saved.exclude(self.compute_copy.install())  # the step's weights, not a micro-batch's
        for group in self.program:
            first = self.actions[group[0]]
            clock.mark()
            if first.kind in COMMUNICATION:
                batch = [self.actions[k] for k in group]
                self._run_batch(current, batch)
                clock.stop("wait_s", batch)
            else:
                self.handlers[first.kind](current, first)
                clock.stop(_TIMER.get(first.kind, "optimizer_s"), first)
        self.outbox.drain()  # (done before the optimizer step; a list without one ends here)
        if self.compute_copy is not None:
            self.compute_copy.remove()
        if self.averager is not None and self.averager.due(step):  # after the list's optimizer step
            clock.mark()
            self.averager.average()
            clock.stop("reduce_s", "average")
        self.count_saved = False
        stats = current.stats
        close_step(clock, stats, self.trace)
        if current.losses:  # one read of the device per step
            stats.loss = float(torch.stack(current.losses).float().sum()) / len(current.losses)
            stats.loss_count = len(current.losses)
        return stats

    # --- compute ----------------------------------------------------------------------------
    def _forward(self, step: StepState, action: Action) -> None:
        g, i = action.stage, action.micro_batch
        runner, state = self.runners[g], step.states.setdefault((g, i), MicroBatchState())
        if g > 0 and self._here(g - 1, i):  # handed over in memory by the previous stage
            before = step.states[(g - 1, i)]
            state.received = assemble(runner.stage, own_storages([before.outputs[j].detach() for j in
                                                                       self.runners[g - 1].send_tensors]))
        args = to_device([step.inputs[i][j] for j in runner.wanted_inputs], self.device, copy=True)
        counting = self.count_saved
        with self.saved.counting() if counting else contextlib.nullcontext(), self._autocast():
            out = runner.stage.module(*args, *self._as_computed(state.received))
            if runner.stage.is_last:  # its share of the step is the backward's seed (_loss_seed)
                state.loss = self.spec.loss(out, to_device(step.targets[i], self.device, copy=True))
                problem = loss_problem(state.loss)  # what one process's loss.backward() would refuse
                if problem is not None:
                    raise ValueError(problem)
            else:
                state.outputs = out
        if counting:
            saved = self.saved.saved_storages()
            state.saved_refs = self.saved.saved_refs() if self.split_backward else None
            state.saved_bytes = self.saved.finish()
            runner.learn_kept(state, saved)
        if state.loss is not None:
            step.losses.append(state.loss.detach())
        runner.drop_inputs(state)
        if g > 0 and self._here(g - 1, i):
            self.runners[g - 1].drop_outputs(step.states[(g - 1, i)])

    def _as_computed(self, received: List[Any]) -> List[Any]:
        """What the stage's forward reads of its received values. Under autocast, each leaf that
        needs a gradient as a view of itself: in one process such a value is computed, not a
        leaf, and torch.autocast caches its casts of fp32 leaves that need a gradient (one bf16
        cast shared by all its readers, whose bf16 gradients are then summed in bf16 before the
        cast's backward) but not of other tensors (a cast per reader, each gradient cast to fp32
        and summed in fp32). The view makes the stage cast as one process does; its gradient
        reaches the leaf unchanged."""
        if self.autocast is None:
            return received
        return [t.view_as(t) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad else t
                for t in received]

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _backward(self, step: StepState, action: Action) -> None:
        """The whole backward of one micro-batch: input and weight gradients together."""
        def run(outputs, grads, inputs, params) -> None:
            torch.autograd.backward(outputs, grads)

        if (action.stage, action.micro_batch) in self.arming:
            self.buckets.arm(self.arming[(action.stage, action.micro_batch)])
        self._run_backward(step, action, run)
        self.saved.release(self._done(step, action).saved_bytes)

    def _backward_input(self, step: StepState, action: Action) -> None:
        """Zero-bubble schedules' first part: the gradients of the stage's inputs only (runtime.splitgrad);
        what the weight gradients need stays with the micro-batch until its `_backward_weight`."""
        pending = self._run_backward(step, action, backward_input)  # None: no gradient reaches the stage
        state = self._done(step, action)
        held = state.saved_bytes
        if state.saved_refs is not None:  # a counted step: what the weight part keeps, not all it saved
            self.saved.release(held)
            held = self.saved.held_now(state.saved_refs, pending.kept_gradients() if pending is not None else [])
            self.saved.hold(held)
            state.saved_refs = None
        step.weights[(action.stage, action.micro_batch)] = (pending, held)

    def _backward_weight(self, step: StepState, action: Action) -> None:
        """The second part: the stage's weight gradients of one micro-batch; its graph is freed."""
        key = (action.stage, action.micro_batch)
        if key in self.arming:  # the last one of the step completes its parameters' gradients
            self.buckets.arm(self.arming[key])
        pending, held = step.weights.pop(key)
        if pending is not None:
            backward_weight(pending)
        self.saved.release(held)

    def _run_backward(self, step: StepState, action: Action, run: Callable) -> Any:
        """Backward of (stage, micro-batch) by `run(outputs, grads, inputs, params)` (a loss's grad:
        its share of the step, _loss_seed), returning what it returned (None when no gradient reaches
        the stage and it is not run); then the gradients of the stage's inputs wait for their send
        (or the previous stage)."""
        g, i = action.stage, action.micro_batch
        result = None
        runner, state = self.runners[g], step.states[(g, i)]
        inputs = [state.received[j] for j in runner.recv_grads] if g > 0 else []
        params = self.stage_params[g]
        if runner.stage.is_last:
            if state.loss.requires_grad:  # not when nothing before it trains (every weight frozen)
                result = run([state.loss], [self._loss_seed(state.loss)], inputs, params)
            state.loss = None
        else:
            if self._here(g + 1, i):  # the next stage's backward left them here
                after = step.states.pop((g + 1, i))
                # each laid out as its message would deliver it (the order the plan gives its gradient)
                state.grads = [in_order(grad, order) if present else None for grad, present, order in
                               zip(own_storages(after.input_grads), after.input_present, runner.grad_in.orders)]
            pairs = [(state.outputs[j], grad) for j, grad in zip(runner.send_grads, state.grads)
                     if grad is not None and isinstance(state.outputs[j], torch.Tensor) and state.outputs[j].requires_grad]
            if pairs:
                result = run([t for t, _ in pairs], [grad for _, grad in pairs], inputs, params)
            state.outputs, state.grads = None, []
        if g == 0:
            return result
        received = [state.received[j] for j in runner.recv_grads]
        state.input_present = tuple(t.grad is not None for t in received)
        state.input_grads = [t.grad if t.grad is not None else torch.zeros(t.shape, dtype=t.dtype, device=self.device)
                             for t in received]
        state.received = []
        return result

    def _loss_seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a micro-batch's loss starts its backward with: its share of the step's loss,
        1 / (m x the replicas sharing it), computed as the division `loss / (m x replicas)`'s backward
        computes it (the same bits); in the loss's shape when it holds one element (a loss of shape
        (1,) trains as a scalar one). Made once per dtype and device; a loss that is a leaf (no graph:
        a split backward would hand the seed on as its gradient) gets a copy."""
        key = (loss.dtype, loss.device)
        if key not in self._seeds:
            self._seeds[key] = torch.ones((), dtype=loss.dtype, device=loss.device) / (self.m * self.trainers)
            self.saved.hold_apart(self._seeds[key])
        seed = self._seeds[key]
        if loss.numel() == 1 and loss.dim() > 0:
            seed = seed.reshape(loss.shape)
        return seed if loss.grad_fn is not None else seed.clone()

    def _done(self, step: StepState, action: Action) -> MicroBatchState:
        """The state of a backwarded micro-batch; a first stage's is forgotten (nothing to send back)."""
        key = (action.stage, action.micro_batch)
        return step.states.pop(key) if action.stage == 0 else step.states[key]

    # --- communication ---------------------------------------------------------------------------
    def _run_batch(self, step: StepState, actions: List[Action]) -> None:
        """Wait for the batch of sends posted before (if any), then post this batch's operations
        together: a batch of sends only is left to complete while the rank computes on
        (runtime.outbox); any other is waited for whole, then what arrived is used."""
        self.outbox.drain()  # first: the sent buffers go before this batch's are made (as the plan counts)
        operations, after = [], []
        for action in actions:
            operation, done = self.messages[action.kind](step, action)
            operations.append(operation)
            after.append(done)
        step.stats.messages += len(operations)
        if all(op.send for op in operations):
            self.outbox.add(post(operations, self.use_tags, self.local), operations, after,
                            transfer_delay(actions, self.emulated_links))
            return
        exchange(operations, self.use_tags, self.local)
        hold(actions, self.emulated_links)
        completed(operations, after)

    # --- end of step ----------------------------------------------------------------------------
    def _optimizer_step(self, step: StepState, action: Action) -> None:
        self.outbox.drain()
        # a gradient-sharded optimizer (issue 25, runtime/shard.py) reduces the data-parallel gradients
        # itself: then there are no buckets here
        if self.compute_copy is not None:
            self.compute_copy.remove()  # every backward is done: the optimizer steps the fp32 masters
        self.groups.reduce_gradients(self.rank_model, self.buckets)
        hold_exchange(self.emulated_exchange_s)
        self.clock.stop("reduce_s", "reduce")
        self.clock.mark()
        for hook in self.before_optimizer:
            hook()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
