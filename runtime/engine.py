"""Execute one rank's instruction list, step after step.

A step: `inputs, target = batch(G, step)`, split into m equal micro-batches along dim 0; the
last stage's loss for micro-batch i is `loss(output_i, target_i) / m`, so the accumulated
gradients are those of the mean micro-batch loss, exactly as single-device gradient
accumulation computes them. One optimizer step per stage ends the step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from planner.spec import ModelSpec
from runtime import schedule as sched
from runtime.comm import ACTIVATION, GRADIENT, PointToPoint
from runtime.stage import Stage


class BatchError(ValueError):
    """The model's batch function does not produce what the plan needs."""


def split_micro_batches(obj: Any, global_batch: int, num_micro_batches: int, what: str) -> List[Any]:
    """Split every tensor in `obj` (tensor, tuple, list, dict) into m equal parts along dim 0."""
    size = global_batch // num_micro_batches
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] != global_batch:
            raise BatchError(f"{what} has shape {tuple(obj.shape)}; every batch tensor needs the global batch "
                             f"{global_batch} on dim 0")
        return [obj.narrow(0, i * size, size) for i in range(num_micro_batches)]
    if isinstance(obj, (tuple, list)):
        parts = [split_micro_batches(o, global_batch, num_micro_batches, f"{what}[{j}]") for j, o in enumerate(obj)]
        return [type(obj)(p[i] for p in parts) for i in range(num_micro_batches)]
    if isinstance(obj, dict):
        parts = {k: split_micro_batches(v, global_batch, num_micro_batches, f"{what}[{k!r}]") for k, v in obj.items()}
        return [{k: parts[k][i] for k in obj} for i in range(num_micro_batches)]
    return [obj] * num_micro_batches  # non-tensor values (flags) go to every micro-batch


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@dataclass
class StepStats:
    step: int
    time_s: float
    forward_s: float = 0.0
    backward_s: float = 0.0
    recv_wait_s: float = 0.0
    send_wait_s: float = 0.0
    optimizer_s: float = 0.0
    loss: Optional[float] = None


@dataclass
class _MicroBatchState:
    inputs: List[Any] = field(default_factory=list)  # model inputs this stage reads
    received: List[Any] = field(default_factory=list)  # values crossing the first cut
    outputs: Any = None  # the stage's outputs (kept for backward)
    loss: Optional[torch.Tensor] = None
    target: Any = None


class Engine:
    def __init__(self, spec: ModelSpec, stage: Stage, actions: List[sched.Action], global_batch: int,
                 num_micro_batches: int, optimizer: torch.optim.Optimizer, device: torch.device,
                 comm: Optional[PointToPoint]):
        self.spec = spec
        self.stage = stage
        self.actions = actions
        self.global_batch = global_batch
        self.m = num_micro_batches
        self.optimizer = optimizer
        self.device = device
        self.comm = comm
        # Indices into the sent / received values that are tensors carrying gradients.
        self.send_tensors = [i for i, v in enumerate(stage.send) if v["kind"] == "tensor"]
        self.send_grads = [i for i in self.send_tensors if stage.send[i].get("requires_grad")]
        self.recv_tensors = [i for i, v in enumerate(stage.recv) if v["kind"] == "tensor"]
        self.recv_grads = [i for i in self.recv_tensors if stage.recv[i].get("requires_grad")]

    # --- one step ---------------------------------------------------------------------------
    def run_step(self, step: int) -> StepStats:
        start = time.perf_counter()
        stats = StepStats(step=step, time_s=0.0)
        inputs, target = self.spec.batch(self.global_batch, step)
        if not isinstance(inputs, (tuple, list)):
            raise BatchError("batch() must return (inputs: tuple, target); got a non-tuple inputs")
        wanted = [self.stage.model_inputs.index(name) for name in self.stage.io.inputs]
        micro_inputs = split_micro_batches([inputs[j] for j in wanted], self.global_batch, self.m, "inputs") \
            if wanted else [[] for _ in range(self.m)]
        micro_targets = split_micro_batches(target, self.global_batch, self.m, "target") \
            if self.stage.is_last else [None] * self.m
        states = [_MicroBatchState(inputs=_to(list(micro_inputs[i]), self.device),
                                   target=_to(micro_targets[i], self.device)) for i in range(self.m)]
        losses: List[float] = []
        for action in self.actions:
            kind, i = action.kind, action.micro_batch
            if kind == sched.RECV_ACT:
                t0 = time.perf_counter()
                tensors = self.comm.recv([self.stage.recv[j] for j in self.recv_tensors], self.stage.index - 1,
                                         i, ACTIVATION)
                stats.recv_wait_s += time.perf_counter() - t0
                states[i].received = self._assemble_received(tensors)
            elif kind == sched.FORWARD:
                t0 = time.perf_counter()
                self._forward(states[i])
                stats.forward_s += time.perf_counter() - t0
                if states[i].loss is not None:
                    losses.append(float(states[i].loss.detach()) * self.m)
            elif kind == sched.SEND_ACT:
                outputs = states[i].outputs
                self.comm.send([outputs[j] for j in self.send_tensors], self.stage.index + 1, i, ACTIVATION)
            elif kind == sched.RECV_GRAD:
                t0 = time.perf_counter()
                grads = self.comm.recv([self.stage.send[j] for j in self.send_grads], self.stage.index + 1,
                                       i, GRADIENT)
                stats.recv_wait_s += time.perf_counter() - t0
                states[i].outputs = (states[i].outputs, grads)
            elif kind == sched.BACKWARD:
                t0 = time.perf_counter()
                self._backward(states[i])
                stats.backward_s += time.perf_counter() - t0
            elif kind == sched.SEND_GRAD:
                received = states[i].received
                grads = []
                for j in self.recv_grads:
                    g = received[j].grad
                    grads.append(g if g is not None else torch.zeros_like(received[j]))
                self.comm.send(grads, self.stage.index - 1, i, GRADIENT)
                states[i] = _MicroBatchState()  # free this micro-batch's activations
            elif kind == sched.OPTIMIZER_STEP:
                t0 = time.perf_counter()
                if self.comm is not None:
                    self.comm.wait_sends()
                stats.send_wait_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                stats.optimizer_s += time.perf_counter() - t0
            else:
                raise ValueError(f"unknown action {action}")
        if losses:
            stats.loss = sum(losses) / len(losses)
        stats.time_s = time.perf_counter() - start
        return stats

    def _assemble_received(self, tensors: List[torch.Tensor]) -> List[Any]:
        """Received tensors and injected constants, in the stage's input order."""
        values: List[Any] = []
        it = iter(tensors)
        for spec in self.stage.recv:
            if spec["kind"] == "tensor":
                t = next(it)
                if spec.get("requires_grad"):
                    t.requires_grad_(True)
                values.append(t)
            else:
                values.append(_constant(spec["value"]))
        return values

    def _forward(self, state: _MicroBatchState) -> None:
        out = self.stage.module(*state.inputs, *state.received)
        if self.stage.is_last:
            state.loss = self.spec.loss(out, state.target) / self.m
            state.outputs = None
        else:
            state.outputs = out

    def _backward(self, state: _MicroBatchState) -> None:
        if self.stage.is_last:
            state.loss.backward()
            state.loss = None
            return
        outputs, grads = state.outputs
        pairs = [(outputs[j], g) for j, g in zip(self.send_grads, grads)
                 if isinstance(outputs[j], torch.Tensor) and outputs[j].requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        state.outputs = None


def _constant(value: Any) -> Any:
    """Constants arrive as JSON lists; sizes were tuples in the model."""
    if isinstance(value, list):
        return tuple(_constant(v) for v in value)
    return value
