"""Measure every partition unit on the target device: the numbers behind `planner profile`.

For each micro-batch size b the whole model runs once to obtain every unit's real inputs;
then each unit runs on its own, as the stage module the runtime would build for it, all units
round-robin (planner.profile.timing.measure_units): forward and backward time (median of at least
`repeats` rounds and `min_time_s` seconds after `warmup_s` seconds of warm-up, synchronised on
CUDA; the backward's input and weight parts timed apart as well (planner.profile.splitgrad), with
what splitting costs a stage apart from them (planner.profile.run_timing), and the bytes held between them;
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

import os
import platform
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from planner.model.capture import CaptureError, CapturedModel, capture, run_all_nodes
from planner.model.entry import build_spec
from planner.model.example import EXAMPLE_BATCH_SIZE
from planner.model.failures import NodeRunError, first_line, model_failure
from planner.model.forward_state import pipeline_spec
from planner.model.same_output import check_same_output
from planner.model.spec import ModelEntryError, ModelSpec, batch_problem, call_model, to_device
from planner.model.whole_function import kept_whole
from planner.profile.allocator import retain_freed_memory
from planner.profile.attention import attention_of
from planner.profile.corunners import CoRunners, host_kernel_s
from planner.profile.cut_profile import CutProfile
from planner.profile.data_sized import add_loss_peak, add_unit_peaks, data_sized_json, measuring_step
from planner.profile.hostspeed import REFERENCE_KERNEL, mean_kernel_s
from planner.profile.mixed import MixedRun
from planner.profile.profile import PROFILE_PRECISIONS, Profile
from planner.profile.profile_run import ProfileRun, prepare
from planner.profile.records import (gradient_order, prepare_args, record_cut_values, shared_parameters_json,
                                     tensor_bytes)
from planner.profile.run_timing import measure_optimizer, time_parts, time_units
from planner.profile.saved import held_beside_loss, loss_saved_bytes
from planner.profile.saved_storages import as_first, inner_counts, shared_saved
from planner.profile.subnormal import flushed
from planner.profile.timing import UnitCall

# torch's warning where a gradient accumulated into a leaf is laid out otherwise than the leaf (AccumulateGrad)
LAYOUT_NOTE = "grad and param do not obey the gradient layout contract"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


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
    flush_subnormals: bool = True,
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
    `precision` "bf16-mixed": every unit measured as a bf16-mixed run runs it (`MixedRun`).
    `flush_subnormals`: time with subnormal floats flushed to zero, as the plan's ranks then compute
    (planner.profile.subnormal; this process's setting is restored after)."""
    if precision not in PROFILE_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PROFILE_PRECISIONS)} (got {precision!r})")
    say = progress or (lambda msg: None)
    dev = _device(device, co_runners)
    if threads > 0:
        torch.set_num_threads(threads)
    with flushed(flush_subnormals) as flush:
        retain_freed_memory()  # as every rank does: measure without per-micro-batch page faults
        spec, captured = _capture(entry, model_args, seed, dev, say, precision)
        sizes = sorted(set(int(b) for b in micro_batch_sizes))
        for b in sizes:
            captured.check_batch_size(b, f"profile with --micro-batch-sizes {captured.fixed_batch}")
        run = ProfileRun(spec, captured, dev, repeats, warmup_s, min_time_s, whole_model, say)
        prepare(run, sizes[0], precision)
        run.co = CoRunners(entry, model_args, seed, threads, co_runners, flush) if co_runners > 0 else None
        host_kernel: List[Optional[float]] = []
        try:
            if run.co is not None:
                say(f"started {co_runners} co-runner process(es): the same model's training step on the other "
                    f"core(s) while measuring, as a {co_runners + 1}-rank run on this host has")
            host_kernel.append(host_kernel_s(run.co, dev))
            if run.mixed is not None:
                run.mixed.install()
            try:
                with warnings.catch_warnings():
                    # a unit's timed backward accumulates into the profile's own leaves of its inputs, made to
                    # time it and thrown away; a layer may lay their gradients out otherwise (batch_first
                    # MultiheadAttention transposes them), and torch's note on it concerns those copies'
                    # strides, not the run. Filtered over the whole measurement (a filter per timed call
                    # costs microseconds each): a note on the parameters' copies the profile steps is hidden too
                    warnings.filterwarnings("ignore", message=LAYOUT_NOTE, category=UserWarning)
                    for b in sizes:
                        _measure_size(run, b)
            finally:
                if run.mixed is not None:
                    run.mixed.remove()  # the optimizer steps the fp32 masters
            measure_optimizer(run)
            host_kernel.append(host_kernel_s(run.co, dev))
            if host_kernel[0]:  # whether it drifted too far is steadiest_profile's to judge
                say(f"  host speed: reference kernel {host_kernel[0] * 1e6:.0f} us before, "
                    f"{host_kernel[1] * 1e6:.0f} us after")
        finally:
            if run.co is not None:
                run.co.stop()
        return _profile(run, entry, model_args, seed, sizes, co_runners, host_kernel, precision, flush)


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
    _same_output(spec, captured, dev)
    if precision == "bf16-mixed":  # an exported graph takes the run's casts, as runtime.stage does
        _recast(captured, entry, model_args, seed, spec, dev, say)
    L = len(captured.units)
    if captured.fallback_reason:
        say(f"torch.fx failed ({captured.fallback_reason}); used torch.export")
    say(f"captured {type(spec.module).__name__} with {'torch.fx' if captured.method == 'fx' else 'torch.export'}: "
        f"{L} units ({', '.join(captured.unit_names[:6])}{', …' if L > 6 else ''})")
    for merge in captured.merges + captured.shape_merges:
        say(f"  {', '.join(map(repr, merge.absorbed))} kept in one unit with {merge.kept!r}: {'; '.join(merge.writes)}")
    for function, calls in kept_whole(captured.gm).items():
        say(f"  custom autograd Function {function} kept whole ({calls} call{'s' * (calls > 1)}): its backward "
            "runs its forward again")
    return spec, captured


def _same_output(spec: ModelSpec, captured: CapturedModel, dev: torch.device) -> None:
    """The fp32 graph computes what forward does on the example batch (planner.model.same_output)."""
    inputs = spec.batch(EXAMPLE_BATCH_SIZE, 0)[0]
    problem = batch_problem(inputs, None, EXAMPLE_BATCH_SIZE)
    if problem:  # the profile says so where it measures
        return
    module_device = next((p.device for p in spec.module.parameters()), torch.device("cpu"))
    try:
        check_same_output(spec.module, captured.gm,
                          lambda: call_model(spec.module, to_device(tuple(inputs), module_device, copy=True)),
                          lambda: captured.output_of(run_all_nodes(captured, to_device(tuple(inputs), dev, copy=True))))
    except NodeRunError as e:
        raise model_failure(e, EXAMPLE_BATCH_SIZE) from e


def _recast(captured: CapturedModel, entry: str, model_args: Dict[str, Any], seed: int, spec: ModelSpec,
            dev: torch.device, say: Callable[[str], None]) -> None:
    """planner.model.casts.recast on an exported graph (as runtime.stage does for a bf16-mixed rank)."""
    from planner.model.casts import recast_model

    left = recast_model(captured, entry, model_args, seed, spec.batch(EXAMPLE_BATCH_SIZE, 0)[0], MixedRun.dtype, dev)
    if left:
        say(f"  bf16-mixed: of the captured graph, {left}")


def _measure_size(run: ProfileRun, b: int) -> None:
    """Every unit's times and saved bytes at micro-batch size b, and the values crossing each cut."""
    captured, dev, L = run.captured, run.dev, len(run.captured.units)
    step, peaks = measuring_step(run, b)
    inputs, target = run.spec.batch(b, step)
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
    grad_orders = _gradient_orders(run, inputs, target)
    record_cut_values(captured, values, b, run.grad_flags, run.cut_values, grad_orders)
    work, produced_of = [], []
    for k, (stage, io) in enumerate(run.stages):
        args = prepare_args(values, io.inputs + io.received,
                             {n: run.cut_values[k][n].requires_grad for n in io.received} if k else {}, dev)
        own = {n.name for n in captured.units[k].nodes}
        produced = [i for i, name in enumerate(io.sent) if name in own]
        work.append(UnitCall(stage, args, produced, io.is_last, run.trainable(stage),
                             {i: grad_orders[io.sent[i]] for i in produced if io.sent[i] in grad_orders}))
        produced_of.append(produced)
    if run.co is not None:
        run.co.load(b)
    measured = time_units(run, work, values, target, b)
    parts = time_parts(run, work, values, target, b)
    shared = shared_saved(run, work, target)
    first = [as_first(run, call, target) for call in work]
    # what the loss holds on the last stage when its last unit is recomputed (outside the recomputation)
    output = captured.output_of(values)
    kept = held_beside_loss(values, run.stages[L - 1][1], captured.gm)
    run.units[L - 1].loss_saved_bytes[b] = loss_saved_bytes(run.spec.loss, output, target, kept)
    for k, ((stage, io), timing) in enumerate(zip(run.stages, measured)):
        unit = run.units[k]
        unit.forward_s[b], unit.backward_s[b], unit.saved_bytes[b] = timing.forward_s, timing.backward_s, \
            timing.saved_bytes
        (unit.backward_input_s[b], unit.backward_weight_s[b]), unit.weight_held_bytes[b], \
            unit.weight_kept_bytes[b], unit.weight_calls, unit.weight_walk_nodes = parts[k]
        unit.shared_saved_bytes[b], unit.weight_shared_bytes[b], unit.recomputed_shared_bytes[b], \
            unit.dropped_saved_bytes[b], apart = shared[k]
        if first[k] is not None:  # a stage starting with it holds other storages
            unit.first_saved_bytes[b] = first[k][0]
            # its arguments viewing one storage, and those whose own storage it then saves (planner.cost.received)
            index = {name: i for i, name in enumerate(list(io.inputs) + list(io.received))}
            unit.received_parts[b] = apart
            unit.received_saved_parts[b] = {x: saved for x, views in apart.items() if (saved := {
                v: n for v, n in views.items() if index[v] in first[k][2]})}
            if unit.split_backward:
                unit.first_weight_held_bytes[b] = first[k][1]
        if unit.split_backward and k > 0:  # where its stage computes values it reads from its parameters
            unit.inner_weight_bytes[b], unit.inner_kept_bytes[b], unit.inner_seed_bytes[b], \
                    unit.inner_seed_sources = inner_counts(
                work[k], k, list(io.received), [io.sent[i] for i in produced_of[k]], values,
                unit.weight_held_bytes[b], unit.weight_kept_bytes[b], run.spec.loss, target, run.inner)
        unit.input_bytes[b] = sum(tensor_bytes(values[n]) for n in io.inputs if isinstance(values[n], torch.Tensor))
        unit.output_bytes[b] = sum(tensor_bytes(values[io.sent[i]]) for i in produced_of[k]
                                   if isinstance(values[io.sent[i]], torch.Tensor))
        run.say(f"  b={b:<4} unit {k + 1:>3}/{L} {unit.name:<24} forward {timing.forward_s * 1e3:8.3f} ms  "
                f"backward {timing.backward_s * 1e3:8.3f} ms  saved {timing.saved_bytes / 2**20:8.2f} MiB")
    add_unit_peaks(run, b, peaks)  # where the data sets shapes: a unit's bytes at their largest probed batch
    add_loss_peak(run, b, output, target, kept)  # ... and the loss's, at its largest probed target
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

def _gradient_orders(run: ProfileRun, inputs: Any, target: Any) -> Dict[str, List[int]]:
    """The orders in which the model's backward lays out the gradients of the values crossing cuts, where
    not the values' own (planner.profile.records.gradient_order): one more forward and backward of the
    whole model (its buffers and the random state put back after). A unit's seeds are laid out so
    (UnitCall.grad_orders), as its stage receives them (the runtime sends a gradient in that order)."""
    captured = run.captured
    names = sorted({n.name for k in range(1, len(captured.units)) for n in captured.crossing(k)
                    if run.grad_flags.get(n.name)})
    if not names:
        return {}
    buffers = [(t, t.detach().clone()) for t in captured.gm.buffers()]
    devices = [run.dev] if run.dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), run.forwarding():
            values = run_all_nodes(captured, inputs, grad=True)
            loss = run.spec.loss(captured.output_of(values), target)
            tensors = [(n, values[n]) for n in names if isinstance(values[n], torch.Tensor) and values[n].requires_grad]
            if not tensors or not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                return {}
            grads = torch.autograd.grad(loss, [t for _, t in tensors], allow_unused=True)
    except (RuntimeError, NodeRunError) as e:  # (a value written in place after it crossed; out of memory)
        run.say(f"  gradient layouts not found ({first_line(e)}): each gradient is taken to lie as its value")
        return {}
    finally:
        with torch.no_grad():
            for t, value in buffers:
                t.copy_(value)
    return {n: order for (n, t), g in zip(tensors, grads) if (order := gradient_order(t, g)) is not None}


def _profile(run: ProfileRun, entry: str, model_args: Dict[str, Any], seed: int, sizes: List[int], co_runners: int,
             host_kernel: List[Optional[float]], precision: str = "fp32", flush: bool = False) -> Profile:
    captured, L = run.captured, len(run.captured.units)
    cuts = [CutProfile(before_unit=k, values=[run.cut_values[k][n.name] for n in captured.crossing(k)])
            for k in range(1, L)]
    measured_under = {
        "threads": torch.get_num_threads(), "repeats": run.repeats, "warmup_s": run.warmup_s,
        "min_time_s": run.min_time_s, "order": "round-robin", "co_runners": co_runners,
        "co_runner_load": "the model's training step at the measured micro-batch size" if co_runners else None,
        "cpu_count": os.cpu_count(), "flush_subnormals": flush,
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
               "measured_under": measured_under, "attention": attention_of(run.spec.module),
               **({"data_sized": data_sized_json(run)} if run.data_sized else {})},
        stage_overhead_s=run.stage_overhead,
        split_overhead_s=run.split_overhead,
        weight_walk_s={b: w for b, w in run.weight_walk.items() if w},
        precision=None if precision == "fp32" else precision,
    )
