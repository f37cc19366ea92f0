"""`runtime execute PLAN --engine torch`: the plan run by torch.distributed.pipelining.

Each rank's stages are the fx GraphModules the own engine runs (runtime.stage.build_rank), each
wrapped in torch's `PipelineStage` and driven by torch's schedule class for the plan's schedule:

    gpipe -> ScheduleGPipe        1f1b -> Schedule1F1B
    interleaved -> ScheduleInterleaved1F1B        bfs -> ScheduleLoopedBFS
    zb-v -> ScheduleZBVZeroBubble (the V placement: device r runs stages r and 2p-1-r)

(the public classes torch users and torchtitan run, rather than torch's private action-list runtime
fed with this project's lists: what is proven here is then what such users run; torch builds the
same compute order for these four schedules, but posts its own messages, one batch per action).

Rules (the own engine's, runtime/engine.py, so that both train exactly like one process):
- Every rank builds the batch itself: torch's schedule splits a tensor of sample indices (the only
  "input" it sees), and each stage takes its micro-batch's model inputs, and the last stage its
  target, from this rank's own copy of the batch; model inputs and targets never travel.
- torch passes values between adjacent stages only. A value crossing several cuts (a skip) is an
  output of every stage it skips (the captured stage modules already pass it through, as the own
  engine's messages carry it), so nothing is added; `pass_through_bytes` reports how much of each
  message such values are.
- The last stage returns the loss of micro-batch i, `loss_i / (d·m)` (torch's `loss_fn` passes it
  on, its `scale_grads` is off: one tensor whatever the model's output is); data-parallel
  replicas sum gradients over their replica group (runtime.groups.GradientBuckets, started after
  the schedule's last backward), tied weights over their holders, before the optimizer step.
- torch's metadata inference is static (shapes and dtypes from the plan), so no forward runs on
  made-up data (which would move BatchNorm's running statistics and the dropout generator).

One difference stays: where a stage's input gets no gradient (it reaches the loss only through a
comparison, say), torch sends zeros in its place, so the weights behind it get zero gradients where one
process leaves them None, and weight decay or momentum moves them; the own engine's first gradient
message says which tensors have none (runtime.comm.PresenceLayout; tests/runtime/test_unreached.py).

What torch cannot run is refused before any rank starts (`refusal`). Measured per step: forward
and backward per micro-batch (timed around torch's `forward_one_chunk` / `backward_one_chunk`),
the gradient reductions, the optimizer step; `wait_s` is the rest of the step (torch's messages
and waiting, which it does not expose). Traces have the compute actions, not the messages.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage

from planner.pipeline.actions import Action, ActionKind
from planner.pipeline.topology import Topology
from planner.pipeline.zerobubble import ZERO_BUBBLE_SCHEDULES
from planner.plan.export import TORCH_SCHEDULE_NAMES, torch_layout_refusal
from planner.model.spec import loss_problem, to_device
from planner.profile.cut_profile import from_order, shape_in_order, to_order
from planner.profile.saved import SavedBytes
from runtime.comm import torch_dtype
from runtime.engine import StepStats
from runtime.groups import GradientBuckets, Groups, data_parallel_buckets
from runtime.microbatch import assemble, replica_micro_batches
from runtime.stage import RankModel, RankStage
from runtime.timing import StepClock, close_step

# torch's own split-backward helpers, private to it (`TimedStage._weights_reached` reads its param groups): torch 2.4
# has none, 2.5 other signatures, and a later torch may move them, so a torch without them is refused in one line
# (`torch_refusal`), never an error importing the runtime
try:
    from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc, construct_reverse_graph,
                                                        get_param_groups, reverse_closure)
except ImportError as e:
    _HELPERS_MISSING: Optional[str] = str(e)
else:
    _HELPERS_MISSING = None

# torch's schedule classes: those `planner export` names, and ZBV, which the export does not write
TORCH_SCHEDULES = {**{name: "Schedule" + torch_name for name, torch_name in TORCH_SCHEDULE_NAMES.items()},
                   "zb-v": "ScheduleZBVZeroBubble"}

# the first torch whose _backward helpers take the reverse graph as `_weights_reached` passes it (pytorch#136678,
# merged after 2.5's branch cut)
HELPERS_TORCH = "2.6"
# the helpers `_weights_reached` calls -> how many positional arguments it passes each
_HELPERS = {"construct_reverse_graph": 1, "get_param_groups": 3, "reverse_closure": 3, "_get_grad_fn_or_grad_acc": 1}


def _helper_missing() -> Optional[str]:
    """The first of torch's split-backward helpers this torch lacks, or has taking other arguments, or None."""
    if _HELPERS_MISSING is not None:
        return next((name for name in _HELPERS if name in _HELPERS_MISSING), next(iter(_HELPERS)))
    for name, count in _HELPERS.items():
        try:
            inspect.signature(globals()[name]).bind(*range(count))
        except (TypeError, ValueError):
            return name
    return None


def torch_refusal(schedule: str) -> Optional[str]:
    """Why the installed torch cannot run `schedule` under --engine torch (one line: cause and fix), or None:
    torch's schedule class must take the arguments this engine passes (`scale_grads`, `step(return_outputs=)`),
    and a zero-bubble schedule needs torch's private split-backward helpers."""
    fix = "use --engine own (the default) or upgrade torch"
    name = TORCH_SCHEDULES[schedule]
    cls = getattr(pipelining, name, None)
    if cls is None:
        lacks: Optional[str] = f"torch.distributed.pipelining.{name}"
    elif "scale_grads" not in inspect.signature(cls).parameters:
        lacks = f"{name}(scale_grads=)"
    elif "return_outputs" not in inspect.signature(cls.step).parameters:
        lacks = f"{name}.step(return_outputs=)"
    else:
        lacks = None
    if lacks:
        return (f"--engine torch needs a newer torch, with {lacks} (torch 2.13 has it; this torch is "
                f"{torch.__version__}); {fix}")
    helper = _helper_missing() if schedule in ZERO_BUBBLE_SCHEDULES else None
    if helper:
        return (f"--engine torch needs torch >= {HELPERS_TORCH} with torch.distributed.pipelining._backward.{helper} "
                f"as {schedule}'s split backward calls it (this torch is {torch.__version__}); {fix}")
    return None


def refusal(plan: Any, precision: Optional[str] = None) -> Optional[str]:
    """Why torch.distributed.pipelining cannot run this plan (one line: cause and fix), or None."""
    if plan.schedule not in TORCH_SCHEDULES:
        return (f"--engine torch has no schedule {plan.schedule!r} (torch has no one-stage-per-device zero-bubble "
                f"class; it runs {', '.join(TORCH_SCHEDULES)}); run it with --engine own")
    installed = torch_refusal(plan.schedule)
    if installed:
        return installed
    layout = torch_layout_refusal(plan)
    if layout:
        cause, fix = layout
        return f"--engine torch cannot run a plan with {cause}; run it with --engine own, or {fix}"
    if getattr(plan, "emulated_boundaries", None) or getattr(plan, "emulated_exchange_s", None):
        return ("--engine torch cannot hold messages for an emulated slow link (torch posts its own messages); run "
                "it with --engine own, or re-plan without an emulated link")
    if (precision or getattr(plan, "precision", "fp32")) != "fp32":
        return ("--engine torch runs fp32 plans only (torch's stages receive the plan's dtypes, which autocast "
                "changes); run it with --engine own, or re-plan with --precision fp32")
    return None


def pass_through_bytes(plan: Any) -> List[int]:
    """Per stage: bytes of the tensors it receives and sends on unchanged (values skipping it)."""
    out = []
    for stage in plan.stages:
        sent = {v["name"] for v in stage.send if v["kind"] == "tensor"}
        out.append(sum(int(v.get("bytes", 0)) for v in stage.recv if v["kind"] == "tensor" and v["name"] in sent))
    return out


class _Batch:
    """This step's micro-batches on this rank (its data-parallel replica's share)."""

    def __init__(self) -> None:
        self.inputs: List[List[Any]] = []  # per micro-batch, aligned with the graph's placeholders
        self.targets: List[Any] = []
        self.micro_batch_size = 1

    def index(self, samples: torch.Tensor) -> int:
        """The micro-batch whose sample indices torch's split handed to a stage."""
        return int(samples[0]) // self.micro_batch_size


class StageAsTorchModule(nn.Module):
    """A plan stage as torch's stages call it: forward(samples) on the first stage, forward(*received
    tensors, samples=...) on the others -> the tensors it sends on; the last stage returns the
    micro-batch's loss / (d·m) (one tensor whatever the model's output; torch's loss_fn passes it on)."""

    def __init__(self, stage: RankStage, batch: _Batch, device: torch.device, loss: Callable[[Any, Any], Any],
                 scale: float, split_backward: bool = False):
        super().__init__()
        self.stage_module = stage.module  # registered: its parameters are this module's
        self.stage = stage
        self.batch = batch
        self.device = device
        self.loss, self.scale = loss, scale
        self.wanted = [stage.model_inputs.index(n) for n in stage.io.inputs]
        self.send_tensors = [j for j, v in enumerate(stage.send) if v["kind"] == "tensor"]
        # a value travels in its dimensions' memory order (the plan's `order`, as the own engine sends it):
        # torch's receive buffers are contiguous, so a channels-last activation crosses as its permuted
        # view and is read back with the sender's strides, not as an NCHW copy its convolutions run slowly on
        self.recv_orders = [v.get("order") for v in stage.recv if v["kind"] == "tensor"]
        self.send_orders = [stage.send[j].get("order") for j in self.send_tensors]
        self.split_backward = split_backward

    def forward(self, *received: torch.Tensor, samples: Optional[torch.Tensor] = None) -> Any:
        if self.stage.index == 0:
            samples, received = received[0], ()
        i = self.batch.index(samples)
        inputs = to_device([self.batch.inputs[i][j] for j in self.wanted], self.device, copy=True)
        received = [from_order(t, order) for t, order in zip(received, self.recv_orders)]
        out = self.stage_module(*inputs, *assemble(self.stage, received))
        if self.stage.is_last:  # the loss scaled by its share of the step (the own engine seeds its backward with it)
            loss = self.loss(out, to_device(self.batch.targets[i], self.device, copy=True))
            problem = loss_problem(loss)  # what one process's loss.backward() would refuse
            if problem is not None:
                raise ValueError(problem)
            return loss / self.scale
        # gloo sends contiguous tensors only; a contiguous tensor is returned as itself, and, where the
        # schedule splits the backward, a view or a value that needs a gradient as a copy: torch's input
        # part detaches the stage's outputs in place, which a view refuses (a Llama layer's output is one)
        # and which breaks the weight part where a later unit of the stage saved that value (a residual a
        # LayerNorm read, sent on to the next stage: "a saved tensor that has been detached in-place")
        sent = [to_order(out[j], order).contiguous() for j, order in zip(self.send_tensors, self.send_orders)]
        return tuple(t.clone() if self.split_backward and (t._is_view() or t.requires_grad) else t for t in sent)


def _meta(values: List[Dict[str, Any]]) -> tuple:
    """Meta tensors with the plan's shapes (in memory order, as they travel), dtypes and requires_grad
    (torch's static metadata)."""
    def differentiable(dtype: torch.dtype) -> bool:  # complex activations (an FFT's) carry gradients too
        return dtype.is_floating_point or dtype.is_complex

    return tuple(torch.empty(shape_in_order(v["shape"], v.get("order")), dtype=torch_dtype(v["dtype"]), device="meta")
                 .requires_grad_(bool(v.get("requires_grad")) and differentiable(torch_dtype(v["dtype"])))
                 for v in values if v["kind"] == "tensor")


class TorchEngine:
    """One rank's stages under torch's schedule: `run_step(step) -> StepStats`, as runtime.engine.Engine."""

    def __init__(self, rank_model: RankModel, plan: Any, topology: Topology, rank: int, optimizer: Any,
                 device: torch.device, groups: Groups, trace: Optional[Callable] = None):
        self.spec = rank_model.spec
        self.rank_model = rank_model
        self.topology = topology
        self.replica = topology.replica_of(rank)
        self.global_batch = plan.global_batch
        self.m = plan.num_micro_batches
        self.optimizer = optimizer
        self.device = device
        self.groups = groups
        self.trace = trace
        self.clock = StepClock(device)
        self.saved = SavedBytes(rank_model.parameters())
        self.count_saved = True  # the first step counts what autograd saves (as the own engine)
        self.held: Dict[tuple, int] = {}
        self.before_optimizer: List[Callable[[], None]] = []
        self.batch = _Batch()
        self.batch.micro_batch_size = plan.micro_batch_size
        self.pipeline_group = groups.pipeline_group()
        self.buckets: Optional[GradientBuckets] = None
        if groups.data_parallel_group is not None:
            self.buckets, _ = data_parallel_buckets(rank_model, groups.data_parallel_group)
        S, b = topology.num_stages, plan.micro_batch_size
        scale = float(self.m * topology.data_parallel)
        self.stages = []
        for stage in rank_model.stages:
            inputs = (torch.empty(b, dtype=torch.int64, device="meta"),) if stage.index == 0 else _meta(stage.recv)
            outputs = _meta(stage.send) if not stage.is_last else (torch.empty((), device="meta", requires_grad=True),)
            module = StageAsTorchModule(stage, self.batch, device, self.spec.loss, scale,
                                        split_backward=plan.schedule in ZERO_BUBBLE_SCHEDULES)
            self.stages.append(TimedStage(self, module, stage.index, S, device, input_args=inputs,
                                          output_args=outputs, group=self.pipeline_group))
        schedule_class = getattr(pipelining, TORCH_SCHEDULES[plan.schedule])

        def loss_fn(loss: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
            return loss  # the last stage's output is its loss already

        if plan.schedule in ("gpipe", "1f1b"):
            (stage,) = self.stages
            self.schedule = schedule_class(stage, n_microbatches=self.m, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = schedule_class(self.stages, n_microbatches=self.m, loss_fn=loss_fn, scale_grads=False)
        self.first = any(st.index == 0 for st in rank_model.stages)
        self.last = any(st.is_last for st in rank_model.stages)

    # --- one step -------------------------------------------------------------------------------
    def _load_batch(self, step: int) -> None:
        self.batch.inputs, self.batch.targets = replica_micro_batches(
            self.spec, self.rank_model, self.global_batch, self.topology.data_parallel, self.replica, self.m, step)

    def run_step(self, step: int) -> StepStats:
        stats = StepStats(step=step)
        self._load_batch(step)
        # on the host: a stage reads its micro-batch's number from it (no device synchronisation)
        samples = torch.arange(self.global_batch // self.topology.data_parallel)
        losses: List[torch.Tensor] = []
        clock = self.clock
        clock.start()
        if self.buckets is not None:
            self.buckets.begin_step()
        self.schedule.step(*([samples] if self.first else []), target=samples if self.last else None,
                           losses=losses if self.last else None, return_outputs=False, samples=samples)
        clock.mark()
        self.groups.reduce_gradients(self.rank_model, self.buckets)
        clock.stop("reduce_s", "reduce")
        clock.mark()
        for hook in self.before_optimizer:
            hook()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.stop("optimizer_s", Action(ActionKind.OPTIMIZER_STEP))
        self.count_saved = False
        close_step(clock, stats, self.trace)
        busy = stats.forward_s + stats.backward_s + stats.reduce_s + stats.optimizer_s
        stats.wait_s = max(0.0, stats.time_s - busy)  # torch's messages and waiting for peers
        if losses:
            scale = self.m * self.topology.data_parallel
            stats.loss = sum(float(l.detach()) * scale for l in losses) / len(losses)
            stats.loss_count = len(losses)
        return stats


class TimedStage(PipelineStage):
    """torch's PipelineStage with its compute timed on the engine's clock (and, in the engine's first
    step, what autograd saves for backward counted, as the own engine counts it)."""

    def __init__(self, engine: "TorchEngine", *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.engine = engine
        self._whole: set = set()  # chunks whose whole backward ran in the input part's turn
        self._reached: Optional[bool] = None  # _weights_reached, once known

    @contextlib.contextmanager
    def _timed(self, key: str, kind: ActionKind, chunk: int):
        """The block's time on the engine's clock, as the action (kind, chunk) of this stage."""
        self.engine.clock.mark()
        yield
        self.engine.clock.stop(key, Action(kind, chunk, self.stage_index))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        with self._timed("forward_s", ActionKind.FORWARD, fwd_chunk_id):
            if not engine.count_saved:
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            with engine.saved.counting():
                out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            engine.held[(self.stage_index, fwd_chunk_id)] = engine.saved.finish()
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        # zero-bubble schedules call it for the input part alone (full_backward=False): what the weight
        # part reads stays held until backward_weight_one_chunk, as the own engine counts it
        whole = kwargs.get("full_backward", True)
        if not whole and not self.is_first and not self._weights_reached(bwd_chunk_id):
            # torch's input part finds its weights through the inputs' gradient functions: with none
            # (a frozen front, integer inputs) its weight part would update nothing (torch 2.13), and a
            # weight only the model's own inputs reach (a later stage's embedding of token ids) none, so
            # the whole backward runs now, the weight part's turn passes (torch's own first stage
            # does it the other way round: nothing now, all in the weight part)
            kwargs["full_backward"], whole = True, True
            self._whole.add(bwd_chunk_id)
        with self._timed("backward_s", ActionKind.BACKWARD if whole else ActionKind.BACKWARD_INPUT, bwd_chunk_id):
            out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            if bwd_chunk_id in self.bwd_cache:  # gloo sends contiguous tensors only: torch's input part hands
                # on autograd's gradients as they are (a concatenation's are views of one tensor)
                self.bwd_cache[bwd_chunk_id] = tuple(g.contiguous() if isinstance(g, torch.Tensor) else g
                                                     for g in self.bwd_cache[bwd_chunk_id])
            if whole:
                self.engine.saved.release(self.engine.held.pop((self.stage_index, bwd_chunk_id), 0))
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        # zero-bubble schedules: the weight part of a backward whose input part ran before
        if bwd_chunk_id in self._whole:
            self._whole.discard(bwd_chunk_id)
            return None
        with self._timed("backward_s", ActionKind.BACKWARD_WEIGHT, bwd_chunk_id):
            out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
            self.engine.saved.release(self.engine.held.pop((self.stage_index, bwd_chunk_id), 0))
        return out

    def _weights_reached(self, chunk: int) -> bool:
        """Whether torch's split backward reaches every trainable weight the stage's graph reads: its
        weight part takes the weights whose gradient paths meet the inputs' (torch's own param groups).
        The same for every micro-batch of a stage: found on the first, then kept."""
        if self._reached is None:
            outputs, inputs = self.fwd_cache[chunk]
            outputs = [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
                       if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            graph = construct_reverse_graph(list(filter(None, map(_get_grad_fn_or_grad_acc, outputs))))
            in_graph = set(graph) | {node for parents in graph.values() for node in parents}
            weights = [node for node in (_get_grad_fn_or_grad_acc(p) for p in self.submod.parameters()
                                         if p.requires_grad) if node in in_graph]
            needing = list(filter(None, (_get_grad_fn_or_grad_acc(t) for t in inputs
                                         if isinstance(t, torch.Tensor) and t.requires_grad)))
            groups = get_param_groups(needing, weights, graph) if needing else []
            reached = set().union(*(group["params"] for group in groups))
            # and no two weights whose paths share a node meet the inputs' paths at different nodes (`emb(ids)
            # + pos` read by a cross-attention): torch then groups them by the order it meets those nodes in
            # (a set's), two groups may share that node, and its weight part, one autograd.grad per group
            # without retaining the graph, stopped ("backward through the graph a second time")
            above, _ = reverse_closure(needing, set(), graph)
            meets: Dict[Any, frozenset] = {}  # node on a weight's own path -> where that weight meets the inputs'
            apart = True
            for weight in weights:
                closure, met = reverse_closure([weight], above, graph)
                apart = apart and all(meets.setdefault(node, frozenset(met)) == met for node in closure)
            self._reached = apart and all(node in reached for node in weights)
        return self._reached
