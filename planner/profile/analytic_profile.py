"""`planner profile MODEL --analytic`: a profile computed from shapes, FLOPs and a device spec.

Same units, cuts and fields as a measured profile (the solver cannot tell them apart), built
without running anything real: the model is built under `torch.device("meta")`, captured on
a meta example batch, and each unit's forward (with the loss on the last unit) and backward
run on meta tensors under `analytic.CostCounter`. A 70-billion-parameter model needs no
parameter memory this way.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from planner.errors import CaptureError
from planner.model.capture import CapturedModel, capture, run_all_nodes
from planner.model.example import EXAMPLE_BATCH_SIZE
from planner.model.entry import build_spec
from planner.model.parameter_views import units_passing_parameter_views
from planner.model.running_stats import state_writers
from planner.model.forward_state import loss_value_refused, pipeline_spec, state_read_by_loss
from planner.model.failures import NodeRunError, UnitRunError, describe_node, model_failure, unit_failure
from planner.model.spec import ModelSpec
from planner.profile.analytic import CostCounter, DeviceSpec, device_spec_json, saved_key
from planner.profile.attention import ATTENTION_CHOICES, attention_of, use_memory_efficient
from planner.profile.cut_profile import CutProfile, CutValue
from planner.profile.profile import Profile
from planner.profile.profile_run import InnerSources
from planner.profile.records import as_received, blank_unit, record_cut_values, shared_parameters_json, tensor_bytes
from planner.profile.saved_storages import inner_counts
from planner.profile.saved import Packed, held_beside_loss, loss_saved_bytes, unpack
from planner.profile.splitgrad import BackwardParts, backward_weight, first_part, forward_and_input_part
from planner.profile.timing import UnitCall, _closures, backward_seeds


def _meta(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to("meta")
    if isinstance(obj, (tuple, list)):
        return type(obj)(_meta(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _meta(v) for k, v in obj.items()}
    return obj


def _unit_costs(stage, args: List[Any], produced: List[int], is_last: bool, loss_fn, target,
                device: DeviceSpec):
    """(forward seconds, backward seconds, bytes saved for backward, the backward's two parts) of one
    unit on meta tensors; the parts' FLOPs: the weight part is the weight-gradient matmuls."""
    params = {saved_key(p) for p in stage.parameters()}
    saved: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> Packed:
        key = saved_key(t)
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return Packed(t)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            with CostCounter(device) as forward:
                out = stage(*args)
                if is_last:
                    out = loss_fn(out, target)
    except Exception as e:  # the model's own error, whatever its type: the caller names unit and operation
        raise UnitRunError(-1, "forward", e) from e
    call = UnitCall(stage, args, produced, is_last)
    try:
        with CostCounter(device) as backward:
            tensors, grads = backward_seeds(call, out)
            if tensors:
                torch.autograd.backward(tensors, grads)
    except Exception as e:
        raise UnitRunError(-1, "backward", e) from e
    stage.zero_grad(set_to_none=True)
    # the backward again in its two parts (zero-bubble schedules): their costs and the bytes between
    first: Dict[str, float] = {}

    params = list(stage.parameters())
    trainable = [p for p in params if p.requires_grad]

    def input_part(out):
        with CostCounter(device) as counted:
            pending = first_part(call, out, trainable)
        first["s"] = counted.costs.seconds
        return pending

    pending, held, kept = forward_and_input_part(_closures(call, loss_fn, target)[0], input_part, params)
    with CostCounter(device) as second:
        backward_weight(pending)
    stage.zero_grad(set_to_none=True)
    return (forward.costs.seconds, backward.costs.seconds, sum(saved.values()),
            BackwardParts(first["s"], second.costs.seconds, 0.0, held, kept))


def analytic_profile(entry: str, model_args: Dict[str, Any], micro_batch_sizes: Sequence[int],
                     device: DeviceSpec, seed: int = 0, dtype: Optional[str] = None,
                     progress: Optional[Callable[[str], None]] = None, attention: str = "flash") -> Profile:
    """Capture on the meta device and cost every unit with `device`'s roofline (nothing written).

    attention: "flash" costs every scaled_dot_product_attention call as the memory-efficient kernel
    GPUs run (planner.profile.attention); "as-built" as the meta device runs the model's code."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"unknown attention {attention!r}; use one of {', '.join(ATTENTION_CHOICES)}")
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    with torch.device("meta"):
        spec: ModelSpec = build_spec(entry, model_args, seed)
    if dtype:
        spec.module.to(getattr(torch, dtype))
    cast = (lambda t: t.to(getattr(torch, dtype)) if dtype and t.is_floating_point() else t)

    def meta_batch(b: int):
        inputs, target = spec.batch(b, 0)
        inputs = torch.utils._pytree.tree_map_only(torch.Tensor, cast, _meta(tuple(inputs)))
        return inputs, _meta(target)

    captured: CapturedModel = capture(spec.module, example_inputs=meta_batch(EXAMPLE_BATCH_SIZE)[0])
    spec = pipeline_spec(spec, captured.forward_sets)
    L = len(captured.units)
    kernels = use_memory_efficient(captured.gm.graph) if attention == "flash" else 0
    runs = "memory-efficient" if kernels else attention_of(spec.module)  # what the profile's attention costs
    say(f"captured {type(spec.module).__name__} on the meta device with "
        f"{'torch.fx' if captured.method == 'fx' else 'torch.export'}: {L} units in {time.perf_counter() - start:.1f} s")
    stages = [captured.stage_module(k, k + 1) for k in range(L)]
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    for b in sizes:
        captured.check_batch_size(b, f"profile with --micro-batch-sizes {captured.fixed_batch}")
    inputs0, target0 = meta_batch(sizes[0])
    with torch.enable_grad():
        probe = _run_on_meta(captured, inputs0, sizes[0], grad=True)
    loss_value_refused(spec.loss, captured.output_of(probe), target0)
    state_read_by_loss(spec.loss, spec.module, captured.output_of(probe), target0, [module for module, _ in stages])
    grad_flags = {n: bool(isinstance(v, torch.Tensor) and v.requires_grad) for n, v in probe.items()}
    inner = InnerSources.of(captured, probe, grad_flags)
    views = units_passing_parameter_views(captured, probe)
    del probe
    writers = state_writers(captured)
    units = [blank_unit(u, stages[k][0], k in writers, buffers=False, parameter_view=k in views)
             for k, u in enumerate(captured.units)]
    cut_values: Dict[int, Dict[str, CutValue]] = {k: {} for k in range(1, L)}
    for b in sizes:
        inputs, target = meta_batch(b)
        values = _run_on_meta(captured, inputs, b)
        record_cut_values(captured, values, b, grad_flags, cut_values)
        for k, (stage, io) in enumerate(stages):
            args = []
            for name in io.inputs + io.received:
                v = values[name]
                if isinstance(v, torch.Tensor):
                    v = v.detach().requires_grad_(k > 0 and name in io.received and cut_values[k][name].requires_grad)
                args.append(v)
            own = {n.name for n in captured.units[k].nodes}
            produced = [i for i, name in enumerate(io.sent) if name in own]
            received = as_received(args)
            try:
                fwd, bwd, saved, parts = _unit_costs(stage, args, produced, io.is_last, spec.loss, target, device)
                if received is not None:  # a stage starting with it: its inputs in storages of their own
                    _, _, first_saved, first = _unit_costs(stage, received, produced, io.is_last, spec.loss,
                                                           target, device)
            except UnitRunError as e:
                raise unit_failure(captured.unit_names[k], L, UnitRunError(k, e.phase, e.cause), stage, args) from e
            unit = units[k]
            if received is not None:
                unit.first_saved_bytes[b], unit.first_weight_held_bytes[b] = first_saved, first.held_bytes
            unit.forward_s[b], unit.backward_s[b], unit.saved_bytes[b] = fwd, bwd, saved
            input_share, weight_share = parts.shares()  # of the ops' costs: the parts' sum is the backward's
            unit.backward_input_s[b], unit.backward_weight_s[b] = bwd * input_share, bwd * weight_share
            unit.weight_held_bytes[b], unit.weight_kept_bytes[b] = parts.held_bytes, parts.kept_bytes
            if k > 0:  # where its stage computes values it reads from its parameters (as a measured profile)
                unit.inner_weight_bytes[b], unit.inner_kept_bytes[b], unit.inner_seed_bytes[b], \
                    unit.inner_seed_sources = inner_counts(
                    UnitCall(stage, args, produced, io.is_last), k, list(io.received), [io.sent[i] for i in produced],
                    values, parts.held_bytes, parts.kept_bytes, spec.loss, target, inner)
            unit.output_bytes[b] = sum(tensor_bytes(values[io.sent[i]]) for i in produced
                                       if isinstance(values[io.sent[i]], torch.Tensor))
        units[-1].loss_saved_bytes[b] = loss_saved_bytes(spec.loss, captured.output_of(values), target,
                                                         held_beside_loss(values, stages[-1][1], captured.gm),
                                                         key=saved_key)
        say(f"  b={b:<4} {L} units costed, forward {sum(u.forward_s[b] for u in units) * 1e3:.3f} ms, "
            f"backward {sum(u.backward_s[b] for u in units) * 1e3:.3f} ms ({time.perf_counter() - start:.1f} s)")
        del values
    cuts = [CutProfile(before_unit=k, values=[cut_values[k][n.name] for n in captured.crossing(k)]) for k in range(1, L)]
    return Profile(
        model={"entry": entry, "args": dict(model_args), "seed": seed},
        micro_batch_sizes=sizes, units=units, cuts=cuts, device="analytic", device_name=device.name,
        threads=torch.get_num_threads(),
        dtype=str(next((p.dtype for p in spec.module.parameters()), torch.float32)).replace("torch.", ""),
        torch_version=torch.__version__, capture=captured.method, repeats=0,
        extra={"python": sys.version.split()[0], "shared_parameters": shared_parameters_json(captured),
               "analytic": {"device_spec": device_spec_json(device)}, "attention": runs},
    )


def _run_on_meta(captured: CapturedModel, inputs: Any, b: int, grad: bool = False) -> Dict[str, Any]:
    """run_all_nodes on meta tensors; a node that cannot run there is one line (an operation whose
    result the values decide, such as nonzero, has no meta kernel)."""
    try:
        return run_all_nodes(captured, inputs, grad=grad)
    except NodeRunError as e:
        if not isinstance(e.cause, NotImplementedError):
            raise model_failure(e, b) from e
        raise CaptureError(f"an analytic profile runs the model on the meta device, without data, and "
                           f"{describe_node(e.node)} cannot run there ({type(e.cause).__name__}: an operation whose "
                           "result the values decide, such as nonzero, has no meta kernel); profile it by measurement "
                           "(without --analytic)") from e
