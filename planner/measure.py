"""Measure every partition unit on the target device: the numbers behind `planner profile`.

For each micro-batch size b the whole model runs once to obtain every unit's real inputs;
then each unit runs on its own, as the stage module the runtime would build for it:
forward and backward time (median of `repeats` runs after warm-up, synchronised on CUDA),
bytes saved for backward (counted by saved-tensor hooks as autograd packs them, parameters
excluded, each storage once), parameter bytes, and the bytes of every value crossing each cut.
The last unit's forward includes the loss, as on the runtime's last stage.
"""
from __future__ import annotations

import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from planner.allocator import retain_freed_memory
from planner.capture import CaptureError, CapturedModel, capture, run_all_nodes
from planner.profile import CutProfile, CutValue, Profile, UnitProfile
from planner.spec import ModelSpec, build_spec

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _SavedBytesCounter:
    """Counts the distinct storages autograd saves for backward, ignoring parameters."""

    def __init__(self, parameter_ptrs: set):
        self.parameter_ptrs = parameter_ptrs
        self.storages: Dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.parameter_ptrs and ptr != 0:
            self.storages[ptr] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _unit_step(stage, args: List[Any], produced: List[int], is_last: bool, loss_fn, target, device):
    """Build one forward closure and one backward closure for a unit, timing each."""

    def forward():
        out = stage(*args)
        if is_last:
            return loss_fn(out, target)
        return out

    def backward(out):
        if is_last:
            out.backward()
            return
        tensors = [out[i] for i in produced if isinstance(out[i], torch.Tensor) and out[i].requires_grad]
        if tensors:
            grads = [torch.ones_like(t) for t in tensors]
            torch.autograd.backward(tensors, grads)

    return forward, backward


def measure_unit(stage, args, produced, is_last, loss_fn, target, device, repeats: int, warmup: int = 2):
    """Median forward and backward seconds, and bytes saved for backward, of one unit."""
    forward, backward = _unit_step(stage, args, produced, is_last, loss_fn, target, device)
    parameter_ptrs = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    counter = _SavedBytesCounter(parameter_ptrs)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = forward()
    backward(out)
    saved = counter.total
    forward_times, backward_times = [], []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        t1 = time.perf_counter()
        backward(out)
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            forward_times.append(t1 - t0)
            backward_times.append(t2 - t1)
    stage.zero_grad(set_to_none=True)
    return statistics.median(forward_times), statistics.median(backward_times), saved


def _prepare_args(values: Dict[str, Any], names: Sequence[str], grad_flags: Dict[str, bool], device) -> List[Any]:
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
                record.requires_grad = grad_flags.get(node.name, False) and v.is_floating_point()
                record.shape[b] = list(v.shape)
                record.bytes[b] = _tensor_bytes(v)
            else:
                record.value[b] = encode_constant(v, f"value {node.name!r} crossing cut {k}")


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def shared_parameters_json(captured: CapturedModel) -> List[Dict[str, Any]]:
    """Tied weights for the profile: each unit using one counts its bytes in its param_bytes."""
    return [{"name": p.name, "names": p.names, "units": p.units, "bytes": p.bytes}
            for p in captured.shared_parameters()]


def profile_model(
    entry: str,
    model_args: Dict[str, Any],
    micro_batch_sizes: Sequence[int],
    device: str = "cpu",
    seed: int = 0,
    threads: int = 1,
    repeats: int = 5,
    progress: Optional[Callable[[str], None]] = None,
) -> Profile:
    """Capture and measure a model; return its profile (nothing written)."""
    say = progress or (lambda msg: None)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CaptureError("--device cuda was asked for but CUDA is not available here; use --device cpu")
    if threads > 0:
        torch.set_num_threads(threads)
    retain_freed_memory()  # as every rank does: measure without per-micro-batch page faults
    spec: ModelSpec = build_spec(entry, model_args, seed)
    captured: CapturedModel = capture(spec.module)
    captured.gm.to(dev)
    L = len(captured.units)
    if captured.fallback_reason:
        say(f"torch.fx failed ({captured.fallback_reason}); used torch.export")
    say(f"captured {type(spec.module).__name__} with {'torch.fx' if captured.method == 'fx' else 'torch.export'}: "
        f"{L} units ({', '.join(captured.unit_names[:6])}{', …' if L > 6 else ''})")

    stages = [captured.stage_module(k, k + 1) for k in range(L)]
    sizes = sorted(set(int(b) for b in micro_batch_sizes))

    # Which crossing values carry gradients: one forward with autograd on, at the smallest size.
    inputs0, _ = spec.batch(sizes[0], 0)
    with torch.enable_grad():
        probe = run_all_nodes(captured, to_device(tuple(inputs0), dev), grad=True)
    grad_flags = {n: bool(isinstance(v, torch.Tensor) and v.requires_grad) for n, v in probe.items()}
    del probe

    unit_records = [UnitProfile(name=u.name, param_bytes=sum(_tensor_bytes(p) for p in stages[k][0].parameters()),
                                forward_s={}, backward_s={}, saved_bytes={}, output_bytes={},
                                nodes=[n.name for n in u.nodes])
                    for k, u in enumerate(captured.units)]
    cut_values: Dict[int, Dict[str, CutValue]] = {k: {} for k in range(1, L)}
    for b in sizes:
        inputs, target = spec.batch(b, 0)
        inputs, target = to_device(tuple(inputs), dev), to_device(target, dev)
        values = run_all_nodes(captured, inputs)
        record_cut_values(captured, values, b, grad_flags, cut_values)
        for k, (stage, io) in enumerate(stages):
            args = _prepare_args(values, io.inputs + io.received,
                                 {n: cut_values[k][n].requires_grad for n in io.received} if k else {}, dev)
            own = {n.name for n in captured.units[k].nodes}
            produced = [i for i, name in enumerate(io.sent) if name in own]
            fwd, bwd, saved = measure_unit(stage, args, produced, io.is_last, spec.loss, target, dev, repeats)
            unit = unit_records[k]
            unit.forward_s[b], unit.backward_s[b], unit.saved_bytes[b] = fwd, bwd, saved
            unit.output_bytes[b] = sum(_tensor_bytes(values[io.sent[i]]) for i in produced
                                       if isinstance(values[io.sent[i]], torch.Tensor))
            say(f"  b={b:<4} unit {k + 1:>3}/{L} {unit.name:<24} forward {fwd * 1e3:8.3f} ms  "
                f"backward {bwd * 1e3:8.3f} ms  saved {saved / 2**20:8.2f} MiB")
        del values
    cuts = [CutProfile(before_unit=k, values=[cut_values[k][n.name] for n in captured.crossing(k)])
            for k in range(1, L)]
    return Profile(
        model={"entry": entry, "args": dict(model_args), "seed": seed},
        micro_batch_sizes=sizes,
        units=unit_records,
        cuts=cuts,
        device=dev.type,
        device_name=_device_name(dev),
        threads=torch.get_num_threads(),
        dtype=str(next((p.dtype for p in spec.module.parameters()), torch.float32)).replace("torch.", ""),
        torch_version=torch.__version__,
        capture=captured.method,
        repeats=repeats,
        extra={"python": sys.version.split()[0], "shared_parameters": shared_parameters_json(captured)},
    )
