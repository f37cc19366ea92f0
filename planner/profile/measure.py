"""Measure every partition unit on the target device: the numbers behind `planner profile`.

For each micro-batch size b the whole model runs once to obtain every unit's real inputs;
then each unit runs on its own, as the stage module the runtime would build for it, all units
round-robin (planner.profile.timing.measure_units): forward and backward time (median of at least
`repeats` rounds and `min_time_s` seconds after `warmup_s` seconds of warm-up, synchronised on
CUDA; the backward's input and weight parts timed apart as well (planner.profile.splitgrad), with
what splitting costs a stage apart from them (`_time_parts`), and the bytes held between them;
optionally with co-runner processes loading the other cores as other ranks on the host
would, `CoRunners`), bytes saved for backward (planner.profile.saved), parameter bytes, and the
bytes of every value crossing each cut. The last unit's forward includes the loss, as on the
runtime's last stage. The link between two ranks is planner.profile.link.

`precision="bf16-mixed"` (`planner profile --precision bf16-mixed`) measures all of it with the units
run as a bf16-mixed rank runs its stages (`MixedRun`): every byte count is then what such a run holds
(what autocast keeps in fp32 included), the cut values' dtypes are the run's, and the times are the
units' under autocast on the measuring device. The profile records it (Profile.precision).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from planner.model.capture import CaptureError, CapturedModel, capture, run_all_nodes
from planner.model.entry import build_spec
from planner.model.forward_state import pipeline_spec, state_read_by_loss
from planner.model.failures import NodeRunError, UnitRunError, first_line, model_failure, unit_failure
from planner.model.spec import ModelEntryError, ModelSpec, batch_problem, to_device
from planner.model.running_stats import keeps_running_statistics
from planner.profile.allocator import retain_freed_memory
from planner.profile.analytic import saved_key
from planner.profile.corunners import CoRunners, host_kernel_s
from planner.profile.hostspeed import REFERENCE_KERNEL, SLOWDOWN_WARN, mean_kernel_s
from planner.profile.mixed import MixedRun
from planner.profile.optim import OPTIMIZERS
from planner.profile.profile import PROFILE_PRECISIONS, CutProfile, CutValue, Profile, UnitProfile
from planner.profile.saved import SavedBytes, loss_saved_bytes
from planner.profile.splitgrad import backward_weight, first_part, forward_and_input_part, measure_backward_parts
from planner.profile.timing import (UnitCall, UnitTiming, _closures, _InputRestore, measure_optimizer_steps,
                                    measure_units, split_call_overhead, weight_walk)
from planner.profile.attention import attention_of

_CONSTANT_TYPES = (bool, int, float, str, type(None))


def encode_constant(value: Any, where: str) -> Any:
    """A non-tensor value crossing a cut, as JSON (sizes, ints, flags)."""
    if isinstance(value, _CONSTANT_TYPES):
        return value
    if isinstance(value, (tuple, list, torch.Size)):
        return [encode_constant(v, where) for v in value]
    raise CaptureError(
        f"{where} is a {type(value).__name__}, which cannot cross a pipeline cut; "
        "compute it inside one submodule (so it stays within a unit) or return tensors")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tail_firsts(num_units: int) -> List[int]:
    """The first units of the stages [first, L) timed whole: the whole model, a later stage from unit
    1 (its split backward's per-stage cost), and a second from the middle (the weight part's walk
    and its per-stage cost apart)."""
    L = num_units
    return [0] + ([1] if L >= 3 else []) + ([(L + 1) // 2] if L >= 4 else [])


def _stage_item(run: "_Run", values: Dict[str, Any], first: int) -> UnitCall:
    """Units [first, L) as the last stage of a run calls them (what crosses cut `first` carries
    gradients as it does there); the stage module built once (`_prepare`)."""
    stage, io = run.tails[first]
    flags = {n: run.cut_values[first][n].requires_grad for n in io.received} if first else {}
    return UnitCall(stage, _prepare_args(values, io.inputs + io.received, flags, run.dev), [], True,
                    run.trainable(stage))


def as_received(args: Sequence[Any]) -> Optional[List[Any]]:
    """A unit's arguments as a stage starting with it gets them, each tensor in a contiguous storage
    of its own (runtime.comm packs a message's tensors, a broadcast view materialised, and the engine
    gives each received tensor, and each micro-batch input, a storage of its own); None where that
    changes no storage (no two share one, none is a view of a larger one)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.layout == torch.strided]
    storages = [t.untyped_storage() for t in tensors]
    if len({saved_key(t) for t in tensors}) == len(tensors) and \
            all(s.nbytes() == t.numel() * t.element_size() for s, t in zip(storages, tensors)):
        return None
    return [a.detach().clone(memory_format=torch.contiguous_format).requires_grad_(a.requires_grad)
            if isinstance(a, torch.Tensor) and a.layout == torch.strided else a for a in args]


def _prepare_args(values: Dict[str, Any], names: Sequence[str], grad_flags: Dict[str, bool], device) -> List[Any]:
    """A unit's arguments as the unit before it in a stage hands them over (sharing storages as in
    the model), leaves needing a gradient where `grad_flags` says."""
    args = []
    for name in names:
        v = values[name]
        if isinstance(v, torch.Tensor):
            v = v.detach().to(device)
            if grad_flags.get(name, False):
                v.requires_grad_(True)
        args.append(v)
    return args


def record_cut_values(captured: CapturedModel, values: Dict[str, Any], b: int, grad_flags: Dict[str, bool],
                      cut_values: Dict[int, Dict[str, CutValue]]) -> None:
    """Add micro-batch size b's shapes, bytes and constants of every value crossing every cut
    (from one run's node values) to `cut_values[k][name]`, creating records on first sight."""
    for k in range(1, len(captured.units)):
        for node in captured.crossing(k):
            v = values[node.name]
            record = cut_values[k].setdefault(node.name, CutValue(
                name=node.name, kind="tensor" if isinstance(v, torch.Tensor) else "constant"))
            if isinstance(v, torch.Tensor):
                record.dtype = str(v.dtype).replace("torch.", "")
                # complex activations (an FFT's) carry gradients as floating ones do
                record.requires_grad = grad_flags.get(node.name, False) and (v.is_floating_point() or v.is_complex())
                record.shape[b] = list(v.shape)
                record.bytes[b] = _tensor_bytes(v)
            else:
                record.value[b] = encode_constant(v, f"value {node.name!r} crossing cut {k}")


def shared_parameters_json(captured: CapturedModel) -> List[Dict[str, Any]]:
    """Tied weights for the profile: each unit using one counts its bytes in its param_bytes."""
    return [{"name": p.name, "names": p.names, "units": p.units, "bytes": p.bytes, "trainable": p.trainable}
            for p in captured.shared_parameters()]


def unit_parameter_bytes(params: Sequence[torch.Tensor]) -> Tuple[int, int]:
    """(all, trainable) bytes of a unit's parameters: trainable ones have requires_grad."""
    params = list(params)
    return (sum(_tensor_bytes(p) for p in params),
            sum(_tensor_bytes(p) for p in params if p.requires_grad))


def blank_unit(unit, module: torch.nn.Module, buffers: bool = True) -> UnitProfile:
    """A captured unit's profile entry before any timing: its parameter bytes (trainable ones too),
    its floating-point buffers' bytes (with `buffers`), whether it keeps running statistics."""
    param_bytes, trainable = unit_parameter_bytes(module.parameters())
    return UnitProfile(name=unit.name, param_bytes=param_bytes, trainable_bytes=trainable, forward_s={},
                       backward_s={}, saved_bytes={}, output_bytes={}, nodes=[n.name for n in unit.nodes],
                       buffer_bytes=sum(_tensor_bytes(b) for b in module.buffers() if b.is_floating_point())
                       if buffers else None,
                       running_stats=keeps_running_statistics(module))


@dataclass
class _Run:
    """One profiling run: the model, its captured units and what has been measured so far."""

    spec: ModelSpec
    captured: CapturedModel
    dev: torch.device
    repeats: int
    warmup_s: float
    min_time_s: float
    whole_model: bool
    say: Callable[[str], None]
    co: Optional[CoRunners] = None  # processes loading the other cores while units are timed
    mixed: Optional[MixedRun] = None  # bf16-mixed: the units run as such a rank runs them
    stages: List[Any] = field(default_factory=list)  # (module, io) of each unit run alone
    tails: Dict[int, Any] = field(default_factory=dict)  # first -> (module, io) of units [first, L) as one stage
    grad_flags: Dict[str, bool] = field(default_factory=dict)  # which crossing values carry gradients
    units: List[UnitProfile] = field(default_factory=list)
    cut_values: Dict[int, Dict[str, CutValue]] = field(default_factory=dict)
    whole_scale: Dict[int, Dict[str, float]] = field(default_factory=dict)
    stage_overhead: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    split_overhead: Dict[int, Tuple[float, float, float]] = field(default_factory=dict)
    weight_walk: Dict[int, float] = field(default_factory=dict)

    def trainable(self, module: torch.nn.Module) -> Optional[List[torch.Tensor]]:
        """UnitCall.params of a call of `module`: the masters under bf16-mixed, else the module's (None)."""
        return self.mixed.trainable(module) if self.mixed is not None else None

    def forwarding(self):
        """The context a forward outside the stage modules runs in (the whole model's values)."""
        return self.mixed.autocast() if self.mixed is not None else contextlib.nullcontext()


def profile_model(
    entry: str,
    model_args: Dict[str, Any],
    micro_batch_sizes: Sequence[int],
    device: str = "cpu",
    seed: int = 0,
    threads: int = 1,
    repeats: int = 5,
    progress: Optional[Callable[[str], None]] = None,
    warmup_s: float = 0.0,
    min_time_s: float = 0.0,
    co_runners: int = 0,
    whole_model: bool = True,
    precision: str = "fp32",
) -> Profile:
    """Capture and measure a model; return its profile (nothing written).

    Units are timed round-robin (`measure_units`) after `warmup_s` seconds of warm-up rounds,
    for at least `repeats` rounds and `min_time_s` seconds per micro-batch size. With
    `co_runners` > 0 (CPU only), that many other processes run the same model's training step
    at the same micro-batch size meanwhile, with the same threads each: the contention for
    cores, caches and memory bandwidth that ranks sharing a host see. What the profile was
    measured under is recorded in its `measured_under`. With `whole_model`, the whole model is
    timed as one more item of every round: a unit timed alone pays a call's fixed cost that a
    stage pays once, which the profile keeps apart as `stage_overhead_s` (`split_call_overhead`,
    forward and backward apart), so that the units and that cost sum to the whole model.
    `precision` "bf16-mixed": every unit measured as a bf16-mixed run runs it (`MixedRun`)."""
    if precision not in PROFILE_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PROFILE_PRECISIONS)} (got {precision!r})")
    say = progress or (lambda msg: None)
    dev = _device(device, co_runners)
    if threads > 0:
        torch.set_num_threads(threads)
    retain_freed_memory()  # as every rank does: measure without per-micro-batch page faults
    spec, captured = _capture(entry, model_args, seed, dev, say, precision)
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    for b in sizes:
        captured.check_batch_size(b, f"profile with --micro-batch-sizes {captured.fixed_batch}")
    run = _Run(spec, captured, dev, repeats, warmup_s, min_time_s, whole_model, say)
    _prepare(run, sizes[0], precision)
    run.co = CoRunners(entry, model_args, seed, threads, co_runners) if co_runners > 0 else None
    host_kernel: List[Optional[float]] = []
    try:
        if run.co is not None:
            say(f"started {co_runners} co-runner process(es): the same model's training step on the other "
                f"core(s) while measuring, as a {co_runners + 1}-rank run on this host has")
        host_kernel.append(host_kernel_s(run.co, dev))
        if run.mixed is not None:
            run.mixed.install()
        try:
            for b in sizes:
                _measure_size(run, b)
        finally:
            if run.mixed is not None:
                run.mixed.remove()  # the optimizer steps the fp32 masters
        _measure_optimizer(run)
        host_kernel.append(host_kernel_s(run.co, dev))
        if host_kernel[0]:  # whether it drifted too far is steadiest_profile's to judge
            say(f"  host speed: reference kernel {host_kernel[0] * 1e6:.0f} us before, {host_kernel[1] * 1e6:.0f} us "
                "after")
    finally:
        if run.co is not None:
            run.co.stop()
    return _profile(run, entry, model_args, seed, sizes, co_runners, host_kernel, precision)


def _device(device: str, co_runners: int) -> torch.device:
    """The device to measure on, checked against the request."""
    dev = torch.device(device)
    if co_runners < 0:
        raise ValueError(f"co_runners must be >= 0 (got {co_runners})")
    if co_runners and dev.type != "cpu":
        raise CaptureError("co-runners (--ranks-per-host > 1) model ranks sharing a CPU host; they apply to "
                           "--device cpu only")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CaptureError("--device cuda was asked for but CUDA is not available here; use --device cpu")
    return dev


def _capture(entry: str, model_args: Dict[str, Any], seed: int, dev: torch.device,
             say: Callable[[str], None], precision: str = "fp32") -> Tuple[ModelSpec, CapturedModel]:
    spec: ModelSpec = build_spec(entry, model_args, seed)
    captured: CapturedModel = capture(spec.module)
    spec = pipeline_spec(spec, captured.forward_sets)
    captured.to(dev)
    if precision == "bf16-mixed":  # an exported graph takes the run's casts, as runtime.stage does
        _recast(captured, entry, model_args, seed, spec, dev, say)
    L = len(captured.units)
    if captured.fallback_reason:
        say(f"torch.fx failed ({captured.fallback_reason}); used torch.export")
    say(f"captured {type(spec.module).__name__} with {'torch.fx' if captured.method == 'fx' else 'torch.export'}: "
        f"{L} units ({', '.join(captured.unit_names[:6])}{', …' if L > 6 else ''})")
    for merge in captured.merges + captured.shape_merges:
        say(f"  {', '.join(map(repr, merge.absorbed))} kept in one unit with {merge.kept!r}: {'; '.join(merge.writes)}")
    return spec, captured


def _recast(captured: CapturedModel, entry: str, model_args: Dict[str, Any], seed: int, spec: ModelSpec,
            dev: torch.device, say: Callable[[str], None]) -> None:
    """planner.model.casts.recast on an exported graph (as runtime.stage does for a bf16-mixed rank)."""
    from planner.model.casts import recast_model
    from planner.model.example import EXAMPLE_BATCH_SIZE

    left = recast_model(captured, entry, model_args, seed, spec.batch(EXAMPLE_BATCH_SIZE, 0)[0], MixedRun.dtype, dev)
    if left:
        say(f"  bf16-mixed: of the captured graph, {left}")


def _prepare(run: _Run, smallest: int, precision: str = "fp32") -> None:
    """Each unit as a stage of its own (and the stages of units [first, L) that `_time_units` and
    `_time_parts` time whole), which crossing values carry gradients, and empty records; under
    bf16-mixed the modules then run as such a run's (`MixedRun`: its graph rules edit the whole
    model's graph, from which no stage is cut after it)."""
    captured, L = run.captured, len(run.captured.units)
    run.stages = [captured.stage_module(k, k + 1) for k in range(L)]
    if run.whole_model:
        run.tails = {first: captured.stage_module(first, L) for first in _tail_firsts(L)}
    # Which crossing values carry gradients: one forward with autograd on, at the smallest size.
    inputs0, target0 = run.spec.batch(smallest, 0)
    problem = batch_problem(inputs0, target0, smallest)
    if problem:
        raise ModelEntryError(problem)
    if precision == "bf16-mixed":  # the probe too: an exported graph's casts expect the bf16 copies
        run.mixed = MixedRun([captured.gm] + [m for m, _ in run.stages] + [m for m, _ in run.tails.values()], run.dev)
        run.mixed.install()
    with torch.enable_grad():
        try:
            with run.forwarding():
                probe = run_all_nodes(captured, to_device(tuple(inputs0), run.dev), grad=True)
        except NodeRunError as e:
            raise model_failure(e, smallest) from e
        finally:
            if run.mixed is not None:
                run.mixed.remove()
    run.grad_flags = {n: bool(isinstance(v, torch.Tensor) and v.requires_grad) for n, v in probe.items()}
    # a loss reading what forward sets on the model, or state the last stage does not hold, stops here in one line
    state_read_by_loss(run.spec.loss, run.spec.module, captured.output_of(probe), to_device(target0, run.dev),
                       [module for module, _ in run.stages])
    del probe
    run.units = [blank_unit(u, run.stages[k][0]) for k, u in enumerate(captured.units)]
    run.cut_values = {k: {} for k in range(1, L)}
    if run.mixed is not None:
        run.spec = dataclasses.replace(run.spec, loss=run.mixed.loss(run.spec.loss))


def _measure_size(run: _Run, b: int) -> None:
    """Every unit's times and saved bytes at micro-batch size b, and the values crossing each cut."""
    captured, dev, L = run.captured, run.dev, len(run.captured.units)
    inputs, target = run.spec.batch(b, 0)
    problem = batch_problem(inputs, target, b)
    if problem:  # the runtime refuses it too (runtime.microbatch): say so before profiling
        raise ModelEntryError(problem)
    # each in a storage of its own, as the engine gives every micro-batch: a batch's slice of a larger
    # tensor (gpt's target, tokens[:, 1:]) would be saved by the loss as the whole storage where a view of
    # it is all it reads (+8 bytes on gpt at b = 1)
    inputs, target = to_device(tuple(inputs), dev, copy=True), to_device(target, dev, copy=True)
    try:
        with run.forwarding():
            values = run_all_nodes(captured, inputs)
    except NodeRunError as e:
        raise model_failure(e, b) from e
    record_cut_values(captured, values, b, run.grad_flags, run.cut_values)
    work, produced_of = [], []
    for k, (stage, io) in enumerate(run.stages):
        args = _prepare_args(values, io.inputs + io.received,
                             {n: run.cut_values[k][n].requires_grad for n in io.received} if k else {}, dev)
        own = {n.name for n in captured.units[k].nodes}
        produced = [i for i, name in enumerate(io.sent) if name in own]
        work.append(UnitCall(stage, args, produced, io.is_last, run.trainable(stage)))
        produced_of.append(produced)
    if run.co is not None:
        run.co.load(b)
    measured = _time_units(run, work, values, target, b)
    parts = _time_parts(run, work, values, target, b)
    shared = _shared_saved(run, work, target)
    first = [_as_first(run, call, target) for call in work]
    # what the loss holds on the last stage when its last unit is recomputed (outside the recomputation)
    run.units[L - 1].loss_saved_bytes[b] = loss_saved_bytes(run.spec.loss, captured.output_of(values), target)
    for k, ((stage, io), timing) in enumerate(zip(run.stages, measured)):
        unit = run.units[k]
        unit.forward_s[b], unit.backward_s[b], unit.saved_bytes[b] = timing.forward_s, timing.backward_s, \
            timing.saved_bytes
        (unit.backward_input_s[b], unit.backward_weight_s[b]), unit.weight_held_bytes[b], \
            unit.weight_kept_bytes[b], unit.weight_calls, unit.weight_walk_nodes = parts[k]
        unit.shared_saved_bytes[b], unit.weight_shared_bytes[b], unit.recomputed_shared_bytes[b], \
            unit.dropped_saved_bytes[b] = shared[k]
        if first[k] is not None:  # a stage starting with it holds other storages
            unit.first_saved_bytes[b] = first[k][0]
            if unit.split_backward:
                unit.first_weight_held_bytes[b] = first[k][1]
        unit.input_bytes[b] = sum(_tensor_bytes(values[n]) for n in io.inputs if isinstance(values[n], torch.Tensor))
        unit.output_bytes[b] = sum(_tensor_bytes(values[io.sent[i]]) for i in produced_of[k]
                                   if isinstance(values[io.sent[i]], torch.Tensor))
        run.say(f"  b={b:<4} unit {k + 1:>3}/{L} {unit.name:<24} forward {timing.forward_s * 1e3:8.3f} ms  "
                f"backward {timing.backward_s * 1e3:8.3f} ms  saved {timing.saved_bytes / 2**20:8.2f} MiB")
    if b in run.stage_overhead:
        call_f, call_b = run.stage_overhead[b]
        run.say(f"  b={b:<4} a stage's own cost per micro-batch (whole model vs its units timed alone): "
                f"forward {call_f * 1e3:.3f} ms  backward {call_b * 1e3:.3f} ms")
    first_input, later_input, later_weight = run.split_overhead[b]
    run.say(f"  b={b:<4} a split backward's own cost per micro-batch (zero-bubble schedules): the first stage's "
            f"input part {first_input * 1e3:.3f} ms; a later stage's input part {later_input * 1e3:.3f} ms, weight "
            f"part {later_weight * 1e3:.3f} ms on top of its units'"
            + (f", and {run.weight_walk[b] * 1e9:.0f} ns per call per autograd node of the stage's earlier units it walks"
               if run.weight_walk.get(b) else ""))


def _as_first(run: _Run, call: UnitCall, target: Any) -> Optional[Tuple[int, int]]:
    """(saved bytes, bytes held from its input part to its weight part) of a unit run as a stage's
    first, its inputs each in a storage of its own (`as_received`); None where that is how it runs
    inside a stage too. One more forward, and one with its input part."""
    received = as_received(call.args)
    if received is None:
        return None
    first = UnitCall(call.module, received, call.produced, call.is_last, call.params)
    forward, _ = _closures(first, run.spec.loss, target)
    counter = SavedBytes(call.module.parameters())
    with torch.enable_grad():
        with counter.counting():
            result = forward()
        saved = counter.finish()
        del result
        trainable = call.trainable()
        pending, held, _ = forward_and_input_part(forward, lambda out: first_part(first, out, trainable),
                                                  list(call.module.parameters()))
        backward_weight(pending)
    call.module.zero_grad(set_to_none=True)
    return saved, held


class _StorageNames(torch.fx.Interpreter):
    """Runs a unit node by node, naming each storage a value occupies after the first node that
    produced it (a view is its base's), or after a `shareable` value it holds (an in-place op's
    result sent on by that name): `names` {data pointer: node name}. Every value stays referenced
    until `forget`: a freed value's address taken by a later one would give that one its name."""

    def __init__(self, module: torch.fx.GraphModule, shareable: Set[str]):
        super().__init__(module)
        self.shareable, self.names = shareable, {}
        self.values: List[torch.Tensor] = []

    def forget(self) -> None:
        """Drop the run's values (they hold their autograd nodes)."""
        self.env.clear()
        self.values.clear()

    def run_node(self, node):
        result = super().run_node(node)
        for value in (result if isinstance(result, (tuple, list)) else (result,)):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr():
                self.values.append(value)
                ptr = value.untyped_storage().data_ptr()
                if ptr not in self.names or (node.name in self.shareable and self.names[ptr] not in self.shareable):
                    self.names[ptr] = node.name
        return result


def _shared_saved(run: _Run, work: List[UnitCall], target: Any
                  ) -> List[Tuple[Dict[str, int], Dict[str, int], Dict[str, int], Dict[str, int]]]:
    """Per unit, the storages its forward saves that hold a value other units may save too
    (UnitProfile.shared_saved_bytes), by that value's name: its inputs, its outputs for later
    units, and values every stage computes again; and of them, those it still holds after its input
    part (UnitProfile.weight_shared_bytes: a zero-bubble stage's last unit); the storages of its
    arguments, which it keeps when recomputed (UnitProfile.recomputed_shared_bytes); and the storages it
    saves that autograd frees as the forward returns, its outputs held (UnitProfile.dropped_saved_bytes,
    by the same names, "" for the rest). One more forward of each unit (`_StorageNames`), and its input
    part."""
    out = []
    for k, call in enumerate(work):
        _, io = run.stages[k]
        shareable = set(io.inputs) | set(io.received) | set(io.sent) | \
            {n.name for n in call.module.graph.nodes if n.name in run.captured.recomputed}
        naming = _StorageNames(call.module, shareable)
        counter, restore = SavedBytes(call.module.parameters()), _InputRestore(call)  # (the inputs before it runs)
        with torch.enable_grad():
            with counter.counting():
                with run.forwarding():  # the interpreter does not call the module's forward
                    result = naming.run(*call.args)
                if call.is_last:
                    result = run.spec.loss(result, target)
            shared = {naming.names[ptr]: size for ptr, size in counter.saved_storage_bytes().items()
                      if naming.names.get(ptr) in shareable}
            # recomputed, it keeps its tensor arguments (runtime.stage's checkpoint saves them all)
            kept = {}
            for arg in call.args:
                if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() in naming.names:
                    storage = arg.untyped_storage()
                    kept[naming.names[storage.data_ptr()]] = storage.nbytes()
            held: Dict[str, int] = {}
            refs = counter.saved_refs()
            naming.forget()  # the interpreter's values would keep their nodes alive
            # what no node its outputs reach saves: freed now (a storage once, whichever of its packs lives)
            alive = {ptr for ref, ptr, _ in refs if ref() is not None}
            dropped: Dict[str, int] = {}
            for ptr, size in counter.saved_storage_bytes().items():
                if ptr not in alive:
                    name = naming.names.get(ptr) if naming.names.get(ptr) in shared else ""
                    dropped[name] = dropped.get(name, 0) + size
            if shared and k > 0:  # which of them the weight part keeps
                pending = first_part(call, result, call.trainable())
                del result
                alive = {ptr for ref, ptr, _ in refs if ref() is not None}
                held = {naming.names[ptr]: shared[naming.names[ptr]] for ptr in alive
                        if naming.names.get(ptr) in shared}
                backward_weight(pending)
                call.module.zero_grad(set_to_none=True)
        naming.forget()
        restore()
        out.append((shared, held, kept, dropped))
    return out


def _time_parts(run: _Run, work: List[UnitCall], values: Dict[str, Any], target: Any, b: int):
    """Per unit, (input part, weight part) seconds and the bytes held between them; what a split
    costs a stage on top of its units goes to `run.split_overhead[b]` (Profile.split_overhead_s).

    Every unit but the first is timed alone with gradients flowing into its inputs, as in a later
    stage, and so pays what such a stage's split pays once (the engine's calls, the graph's
    analysis). With the whole model measured, the units from the second on are also timed as one
    stage in the same rounds, and `split_call_overhead` keeps that cost apart, as `_time_units`
    does for the whole backward; the weight part's calls also walk the stage's earlier units, so the
    units from the middle on are timed as a stage too, and `weight_walk` finds both its per-stage
    cost and the walk's (quadratic in a stage's units). The whole model's input part is the first
    stage's (it runs no autograd). Without it, each unit's parts as timed and the first unit's input part stand in."""
    L = len(work)
    half = _tail_firsts(L)[-1]  # the second later stage, [half, L)
    extra = [_stage_item(run, values, first) for first in _tail_firsts(L)] if run.whole_model else []
    try:
        parts = measure_backward_parts(work + extra, run.spec.loss, target, run.dev, run.repeats)
    except torch.cuda.OutOfMemoryError:  # the model does not fit as one stage here: its units alone
        torch.cuda.empty_cache()
        extra, parts = [], measure_backward_parts(work, run.spec.loss, target, run.dev, run.repeats)
    units, stages = parts[:L], parts[L:]
    input_s, weight_s = [p.input_s for p in units], [p.weight_s for p in units]
    later_input = later_weight = walk = 0.0
    if len(stages) >= 2:
        inputs = split_call_overhead(input_s[1:], stages[1].input_s)
        input_s[1:], later_input = inputs.unit_s, inputs.call_s
        # the weight part's calls walk the graph below them: quadratic in a stage's units (weight_walk)
        fit = weight_walk(weight_s[1:], [p.weight_calls for p in units[1:]], [p.graph_nodes for p in units[1:]],
                          [(0, stages[1].weight_s)] + ([(half - 1, stages[2].weight_s)] if len(stages) > 2 else []))
        weights, walk = fit or (split_call_overhead(weight_s[1:], stages[1].weight_s), 0.0)
        weight_s[1:], later_weight = weights.unit_s, weights.call_s
    run.split_overhead[b] = ((stages[0] if stages else units[0]).input_s, later_input, later_weight)
    run.weight_walk[b] = walk
    return [((i, w), p.held_bytes, p.kept_bytes, p.weight_calls, p.graph_nodes)
            for i, w, p in zip(input_s, weight_s, units)]


def _time_units(run: _Run, work: List[UnitCall], values: Dict[str, Any], target: Any, b: int) -> List[UnitTiming]:
    """The units timed round-robin, with the whole model timed in the same rounds: a unit timed
    alone pays a call's fixed cost (module call, autograd.backward, the seed gradient) that a stage
    of several units pays once; it is kept apart as the stage's own cost (BENCHMARKS.md: what it
    amounts to on the built-in models)."""
    loss, dev = run.spec.loss, run.dev
    whole = _stage_item(run, values, 0) if run.whole_model else None  # all units, as a 1-stage run calls them
    try:
        measured = measure_units(work + ([whole] if whole else []), loss, target, dev, run.repeats,
                                 warmup_s=run.warmup_s, min_time_s=run.min_time_s)
    except UnitRunError as e:
        if e.index == len(work):  # the whole model as one stage, after each of its units ran alone
            raise CaptureError(f"the whole model as one stage raised {first_line(e.cause)} in its {e.phase} "
                               "(each unit alone did not); PLANNER_TRACEBACK=1 shows the stack") from e
        raise unit_failure(run.captured.unit_names[e.index], len(work), e, work[e.index].module,
                           work[e.index].args) from e
    except torch.cuda.OutOfMemoryError:
        if whole is None:
            raise
        whole = None  # the model does not fit as one stage here: unit times as measured
        torch.cuda.empty_cache()
        measured = measure_units(work, loss, target, dev, run.repeats, warmup_s=run.warmup_s,
                                 min_time_s=run.min_time_s)
    if whole is None:
        return measured
    whole_timing, measured = measured[-1], measured[:-1]
    forward = split_call_overhead([t.forward_s for t in measured], whole_timing.forward_s)
    backward = split_call_overhead([t.backward_s for t in measured], whole_timing.backward_s)
    run.whole_scale[b] = {"forward": forward.scale, "backward": backward.scale}
    run.stage_overhead[b] = (forward.call_s, backward.call_s)
    return [UnitTiming(f, g, t.saved_bytes) for f, g, t in zip(forward.unit_s, backward.unit_s, measured)]


def _measure_optimizer(run: _Run) -> None:
    """One optimizer step over each unit's parameters, under the same load as the units: the ranks
    step their optimizers while the others compute."""
    steps = measure_optimizer_steps([list(stage.parameters()) for stage, _ in run.stages], run.dev, run.repeats,
                                    min_time_s=min(run.min_time_s, 0.5))
    for unit, step in zip(run.units, steps):
        unit.optimizer_s = step
    totals = {name: sum(step.get(name, 0.0) for step in steps) for name in OPTIMIZERS}
    run.say("  optimizer step over all units: " + ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in totals.items()))


def _profile(run: _Run, entry: str, model_args: Dict[str, Any], seed: int, sizes: List[int], co_runners: int,
             host_kernel: List[Optional[float]], precision: str = "fp32") -> Profile:
    captured, L = run.captured, len(run.captured.units)
    cuts = [CutProfile(before_unit=k, values=[run.cut_values[k][n.name] for n in captured.crossing(k)])
            for k in range(1, L)]
    measured_under = {
        "threads": torch.get_num_threads(), "repeats": run.repeats, "warmup_s": run.warmup_s,
        "min_time_s": run.min_time_s, "order": "round-robin", "co_runners": co_runners,
        "co_runner_load": "the model's training step at the measured micro-batch size" if co_runners else None,
        "cpu_count": os.cpu_count(),
        "whole_model_scale": {str(b): s for b, s in run.whole_scale.items()} or None,
        "host_kernel": {"kernel": REFERENCE_KERNEL, "before_s": host_kernel[0], "after_s": host_kernel[1],
                        "mean_s": mean_kernel_s(host_kernel)} if host_kernel[0] else None}
    return Profile(
        model={"entry": entry, "args": dict(model_args), "seed": seed},
        micro_batch_sizes=sizes,
        units=run.units,
        cuts=cuts,
        device=run.dev.type,
        device_name=_device_name(run.dev),
        threads=torch.get_num_threads(),
        dtype=str(next((p.dtype for p in run.spec.module.parameters()), torch.float32)).replace("torch.", ""),
        torch_version=torch.__version__,
        capture=captured.method,
        repeats=run.repeats,
        extra={"python": sys.version.split()[0], "shared_parameters": shared_parameters_json(captured),
               "inplace_merges": [{"unit": m.kept, "absorbed": m.absorbed, "writes": m.writes}
                                  for m in captured.merges],
               "shape_merges": [{"unit": m.kept, "absorbed": m.absorbed, "values": m.writes}
                                for m in captured.shape_merges],
               "measured_under": measured_under, "attention": attention_of(run.spec.module)},
        stage_overhead_s=run.stage_overhead,
        split_overhead_s=run.split_overhead,
        weight_walk_s={b: w for b, w in run.weight_walk.items() if w},
        precision=None if precision == "fp32" else precision,
    )


def host_drift(profile: Profile) -> float:
    """|after / before - 1| of the host-speed reference kernel the profile timed around its
    measurement (0 where it did not: off CPU, older profiles)."""
    host = profile.host_kernel
    return abs(host["after_s"] / host["before_s"] - 1.0) if host.get("before_s") and host.get("after_s") else 0.0


def steadiest_profile(measure: Callable[[], Profile], retries: int,
                      progress: Optional[Callable[[str], None]] = None) -> Profile:
    """`measure()` again, at most `retries` more times, while the host's speed drifted by more than
    SLOWDOWN_WARN during it (a shared machine's slow spell began or ended: some units were timed
    at one speed, some at another); the attempt that drifted least is kept, its count recorded."""
    say = progress or (lambda msg: None)
    attempts = [measure()]
    while host_drift(attempts[-1]) > SLOWDOWN_WARN and len(attempts) <= retries:
        say(f"host speed drifted {host_drift(attempts[-1]) * 100:.0f} % while profiling: profiling again "
            f"(attempt {len(attempts) + 1} of {retries + 1})")
        attempts.append(measure())
    best = min(attempts, key=host_drift)
    if host_drift(best) > SLOWDOWN_WARN:
        say(f"host speed drifted in every attempt; keeping the steadiest ({host_drift(best) * 100:.0f} %): "
            "profile again when the machine is quiet")
    under = best.extra.setdefault("measured_under", {})
    under["attempts"] = len(attempts)
    return best
