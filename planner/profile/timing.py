"""Timing units the way a stage runs them: forward and backward, round-robin over the units, and
one optimizer step over each unit's parameters; and separating a call's fixed cost from them."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from planner.model.failures import UnitRunError
from planner.model.inplace import written_inputs
from planner.profile.cut_profile import from_order, shape_in_order
from planner.profile.optim import OPTIMIZERS, make_optimizer
from planner.profile.saved import SavedBytes


@dataclass
class UnitCall:
    """How to run one unit (or several as one stage): `module(*args)`; `produced`: the indices of
    its outputs that later units use (their gradients drive the backward); the last unit's
    forward includes the loss; `params`: its trainable parameters as the runtime's engine lists
    them for a split backward (None: the module's; under bf16-mixed the fp32 masters, while the
    module holds their compute copies: planner.profile.mixed.MixedRun); `grad_orders`: output index
    -> the order its gradient's dimensions lie in memory where the model's backward lays it out
    otherwise than the output (CutValue.grad_order): its seed is laid out so (`backward_seeds`)."""

    module: torch.nn.Module
    args: List[Any]
    produced: List[int]
    is_last: bool
    params: Optional[List[torch.Tensor]] = None
    grad_orders: Dict[int, List[int]] = field(default_factory=dict)

    def trainable(self) -> List[torch.Tensor]:
        """The trainable parameters a split backward computes gradients for (`params`)."""
        return self.params if self.params is not None else [p for p in self.module.parameters() if p.requires_grad]


@dataclass
class UnitTiming:
    """Median seconds of a unit's forward and backward, and the bytes its forward saves for backward."""

    forward_s: float
    backward_s: float
    saved_bytes: int


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA runs asynchronously): a timer then reads the work's real end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _closures(call: UnitCall, loss_fn, target) -> "tuple[Callable[[], Any], Callable[[Any], None]]":
    """One forward closure and one backward closure for a unit."""

    def forward():
        out = call.module(*call.args)
        if call.is_last:
            return loss_fn(out, target)
        return out

    def backward(out):
        tensors, grads = backward_seeds(call, out)
        if tensors:
            torch.autograd.backward(tensors, grads)

    return forward, backward


def backward_seeds(call: UnitCall, out) -> "tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]":
    """(tensors, their gradients) a unit's backward starts from, the rule every profile times it
    by: the last unit's loss (gradient None: 1), else each produced output that requires grad,
    seeded with ones (what later units would send back), laid out as the model's backward lays out
    its gradient where that is not the output's own layout (`UnitCall.grad_orders`: a batch-first
    LSTM hands its input's gradient back time-major; what a unit keeps for its weight part may
    depend on it, planner.profile.splitgrad)."""
    if call.is_last:
        return [out], [None]
    produced = [i for i in call.produced if isinstance(out[i], torch.Tensor) and out[i].requires_grad]
    return [out[i] for i in produced], [ones_in_order(out[i], call.grad_orders.get(i)) for i in produced]


def ones_in_order(tensor: torch.Tensor, order: Optional[Sequence[int]]) -> torch.Tensor:
    """Ones shaped as `tensor`, its dimensions in memory in `order` (outermost first; None: as `tensor`'s)."""
    if order is None:
        return torch.ones_like(tensor)
    return from_order(torch.ones(shape_in_order(tensor.shape, order), dtype=tensor.dtype, device=tensor.device), order)


class _InputRestore:
    """Puts back the inputs a unit writes into in place (a model input it scales, say) after each
    call, so that every timed call sees the same values (planner.model.inplace.written_inputs)."""

    def __init__(self, call: UnitCall):
        module, args = call.module, call.args
        positions = written_inputs(module) if isinstance(module, torch.fx.GraphModule) else []
        self.saved = [(args[i], args[i].detach().clone()) for i in positions
                      if i < len(args) and isinstance(args[i], torch.Tensor)]

    def __call__(self) -> None:
        with torch.no_grad():
            for arg, value in self.saved:
                arg.copy_(value)


def measure_units(units: Sequence[UnitCall], loss_fn, target, device, repeats: int, warmup: int = 2,
                  warmup_s: float = 0.0, min_time_s: float = 0.0) -> List[UnitTiming]:
    """Forward and backward seconds (medians) and saved bytes of several units, measured
    round-robin: each timed round runs every unit's forward then backward once, so slow drifts of
    the machine (other jobs, frequency) fall on all units alike and each unit runs after the
    others have used the caches, as in a step. `warmup` untimed rounds (and at least `warmup_s`
    seconds of them) come first; then timed rounds until there are `repeats` of them and they took
    at least `min_time_s` seconds."""
    steps = [_closures(call, loss_fn, target) for call in units]
    restores = [_InputRestore(call) for call in units]
    saved = []
    for k, (call, (forward, backward)) in enumerate(zip(units, steps)):
        counter = SavedBytes(call.module.parameters())
        phase = "forward"
        try:
            with counter.counting():
                out = forward()
            phase = "backward"
            backward(out)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # the model's own error, whatever its type: the caller names unit and operation
            raise UnitRunError(k, phase, e) from e
        restores[k]()
        saved.append(counter.finish())
    forward_times: List[List[float]] = [[] for _ in units]
    backward_times: List[List[float]] = [[] for _ in units]
    start = time.perf_counter()
    rounds = 0
    while True:
        warming = rounds < warmup or time.perf_counter() - start < warmup_s
        if not warming and not forward_times[0]:
            timed_start = time.perf_counter()
        if not warming and len(forward_times[0]) >= max(repeats, 1) and \
                time.perf_counter() - timed_start >= min_time_s:
            break
        for k, (forward, backward) in enumerate(steps):
            sync(device)
            t0 = time.perf_counter()
            out = forward()
            sync(device)
            t1 = time.perf_counter()
            backward(out)
            sync(device)
            t2 = time.perf_counter()
            restores[k]()
            if not warming:
                forward_times[k].append(t1 - t0)
                backward_times[k].append(t2 - t1)
            del out
        rounds += 1
    for call in units:
        call.module.zero_grad(set_to_none=True)
    return [UnitTiming(statistics.median(f), statistics.median(b), s)
            for f, b, s in zip(forward_times, backward_times, saved)]


def measure_optimizer_steps(unit_params: Sequence[Sequence[torch.Tensor]], device, repeats: int,
                            min_time_s: float = 0.0) -> List[Dict[str, float]]:
    """Median seconds of one optimizer step over each unit's trainable parameters, per optimizer
    the runtime runs ({"sgd": s, "adamw": s}; {} for a unit without any: frozen weights
    (requires_grad=False) are not stepped). Steps copies of the parameters, with gradients set,
    round-robin over the units after a few untimed rounds (AdamW creates its state in its first
    step), for at least `repeats` rounds and `min_time_s` seconds per optimizer."""
    copies = []
    for params in unit_params:
        mine = [p.detach().clone().requires_grad_(True) for p in params if p.requires_grad]
        for p in mine:
            p.grad = torch.full_like(p, 1e-3)
        copies.append(mine)
    results: List[Dict[str, float]] = [{} for _ in unit_params]
    for name in OPTIMIZERS:
        optimizers = [(k, make_optimizer(name, mine, lr=0.01)) for k, mine in enumerate(copies) if mine]
        times: Dict[int, List[float]] = {k: [] for k, _ in optimizers}
        start, rounds = time.perf_counter(), 0
        while optimizers and (rounds < 3 + max(repeats, 1) or time.perf_counter() - start < min_time_s):
            for k, optimizer in optimizers:
                sync(device)
                t0 = time.perf_counter()
                optimizer.step()
                sync(device)
                if rounds >= 3:
                    times[k].append(time.perf_counter() - t0)
            rounds += 1
        for k, values in times.items():
            results[k][name] = statistics.median(values)
    return results


@dataclass
class CallOverhead:
    """A call's fixed cost apart from the units' own times (`split_call_overhead`)."""

    call_s: float  # c: what a stage pays once per micro-batch, whatever units it holds
    unit_s: List[float]  # t_l: each unit's own time
    scale: float  # how the rest was spread: 1 when c explains the difference alone


def _cross(calls: Sequence[int], nodes: Sequence[int]) -> float:
    """sum_{j < k} nodes_j calls_k: the nodes of earlier units the calls walk."""
    cross, below = 0.0, 0
    for k in range(len(calls)):
        cross += calls[k] * below
        below += nodes[k]
    return cross


def weight_walk(alone: Sequence[float], calls: Sequence[int], nodes: Sequence[int],
                stages: Sequence[Tuple[int, float]]) -> Optional[Tuple[CallOverhead, float]]:
    """(the units' times and c, w) of a later stage's weight part, from its units timed `alone` and
    the stages [first, L) timed whole, `stages` [(first, seconds)], first indexing `alone` (the
    largest stage first).

    Each of a unit's `calls` (parameter groups) walks the graph below its frontier, the nodes of
    the stage's earlier units included, so a stage of units S pays
    sum_{l in S} t_l + c + w sum_{j < k in S} nodes_j calls_k, t_l = max(alone_l - c, 0): c the
    part's cost once per stage that each unit timed alone paid, w the seconds per node per call
    (planner.cost.ranges' walk term). Two stages give both (the linear system, c >= 0, and at most
    half the cheapest unit with calls: noise must not leave one costing nothing); w is then fitted to
    the largest stage. None where it does not walk more than its units alone: then
    split_call_overhead spreads the difference."""
    c = 0.0
    if len(stages) >= 2:
        rows = [(_cross(calls[f:], nodes[f:]), -(len(alone) - f - 1), m - sum(alone[f:])) for f, m in stages[:2]]
        det = rows[0][0] * rows[1][1] - rows[0][1] * rows[1][0]
        if abs(det) > 1e-12 * max(1.0, abs(rows[0][0] * rows[1][1])):
            c = max(0.0, (rows[0][0] * rows[1][2] - rows[1][0] * rows[0][2]) / det)
        # a unit's own calls cost at least what the part pays once: c at most half the cheapest calling unit
        c = min([c] + [0.5 * t for t, n in zip(alone, calls) if n])
    first, whole = stages[0]
    units = [max(t - c, 0.0) for t in alone]
    more, cross = whole - sum(units[first:]) - c, _cross(calls[first:], nodes[first:])
    return (CallOverhead(c, units, 1.0), more / cross) if more > 0 and cross > 0 else None


def split_call_overhead(alone: Sequence[float], whole: float) -> CallOverhead:
    """c, the unit times t and the scale: a stage of units S costs sum_{l in S} t_l + c, and the whole model
    sum_l t_l + c = `whole`, from each unit's time timed alone (`alone`) and the whole model's.

    A unit timed alone pays a call's fixed cost c that a stage of several units pays once, so
    alone_l = t_l + c and sum_l alone_l - whole = (L - 1) c. c is at most the cheapest unit's time
    (no unit costs less than nothing) and at least 0; what c does not explain is spread over the
    units in proportion to their time (scale, 1 when c explains it all):
    t_l = (alone_l - c) (whole - c) / (sum_l alone_l - L c)."""
    L, total = len(alone), sum(alone)
    c = min((total - whole) / (L - 1), min(alone)) if L > 1 and whole > 0 and total > whole else 0.0
    rest = total - L * c
    if rest <= 0 or whole - c <= 0:
        c, rest = 0.0, total
    scale = (whole - c) / rest if rest > 0 else 1.0
    return CallOverhead(c, [(t - c) * scale for t in alone], scale)
