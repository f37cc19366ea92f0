"""What a profile records of a captured model besides its times, for measured and analytic
profiles alike: a unit's arguments as a stage hands them over, the values crossing each cut,
parameter and buffer bytes, tied weights.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from planner.model.capture import CaptureError, CapturedModel
from planner.profile.analytic import saved_key
from planner.profile.cut_profile import CutValue, dense_order
from planner.profile.unit_profile import UnitProfile

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


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def prepare_args(values: Dict[str, Any], names: Sequence[str], grad_flags: Dict[str, bool], device) -> List[Any]:
    """A unit's arguments as the unit before it in a stage hands them over (sharing storages as in
    the model), leaves needing a gradient where `grad_flags` says."""
    args = []
    for name in names:
        v = values[name]
        if isinstance(v, torch.Tensor):
            v = v.detach().to(device)
            if grad_flags.get(name, False):
                v = _grad_leaf(v)
        args.append(v)
    return args


def _grad_leaf(v: torch.Tensor) -> torch.Tensor:
    """`v` needing a gradient, in its own storage. A view whose elements share memory (an `expand`ed
    value handed on) cannot be a leaf: a second gradient reaching it is added in place into the first,
    itself a broadcast view ("more than one element of the written-to tensor refers to a single memory
    location"). Such a value becomes a view of a leaf spanning its storage: the same storage (saved
    bytes are counted per storage), its gradient summed over the shared elements as autograd does in
    the model (the runtime receives such a value as a contiguous copy: planner.profile.records.as_received)."""
    if v.layout != torch.strided or torch._debug_has_internal_overlap(v) == 0:  # 0: no overlap
        return v.requires_grad_(True)
    storage = v.untyped_storage()
    whole = v.new_empty(0).set_(storage, 0, (storage.nbytes() // v.element_size(),), (1,)).requires_grad_(True)
    view = whole.as_strided(v.shape, v.stride(), v.storage_offset())
    view.retain_grad()  # the input part's gradient lands in its .grad as in a leaf's (planner.profile.splitgrad)
    return view


def gradient_order(value: Any, grad: Any) -> Optional[List[int]]:
    """The order `grad`, the model's gradient of the tensor `value`, lies in memory where it is dense
    and that is not the order `value` travels in (`dense_order`, its shape's where None): the
    gradient's `grad_order`. None where they agree, or where the gradient is not dense in any order
    (it travels as the value does)."""
    if not isinstance(grad, torch.Tensor) or grad.layout != torch.strided or grad.shape != value.shape or \
            grad.dim() < 2:
        return None
    mine = list(range(grad.dim())) if grad.is_contiguous() else dense_order(grad)
    theirs = dense_order(value) or list(range(value.dim()))
    return mine if mine is not None and mine != theirs else None


def record_cut_values(captured: CapturedModel, values: Dict[str, Any], b: int, grad_flags: Dict[str, bool],
                      cut_values: Dict[int, Dict[str, CutValue]],
                      grad_orders: Optional[Dict[str, List[int]]] = None) -> None:
    """Add micro-batch size b's shapes, bytes and constants of every value crossing every cut
    (from one run's node values) to `cut_values[k][name]`, creating records on first sight;
    `grad_orders`: the gradients' orders where not the values' (`gradient_order`)."""
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
                record.bytes[b] = tensor_bytes(v)
                order = dense_order(v)
                if order is not None:
                    record.order[b] = order
                if record.requires_grad and grad_orders and node.name in grad_orders:
                    record.grad_order[b] = grad_orders[node.name]
            else:
                record.value[b] = encode_constant(v, f"value {node.name!r} crossing cut {k}")


def shared_parameters_json(captured: CapturedModel) -> List[Dict[str, Any]]:
    """Tied weights for the profile: each unit using one counts its bytes in its param_bytes."""
    return [{"name": p.name, "names": p.names, "units": p.units, "bytes": p.bytes, "trainable": p.trainable}
            for p in captured.shared_parameters()]


def unit_parameter_bytes(params: Sequence[torch.Tensor]) -> Tuple[int, int]:
    """(all, trainable) bytes of a unit's parameters: trainable ones have requires_grad."""
    params = list(params)
    return (sum(tensor_bytes(p) for p in params),
            sum(tensor_bytes(p) for p in params if p.requires_grad))


def blank_unit(unit, module: torch.nn.Module, writes_state: bool, buffers: bool = True,
               parameter_view: bool = False) -> UnitProfile:
    """A captured unit's profile entry before any timing: its parameter bytes (trainable ones too),
    its floating-point buffers' bytes (with `buffers`), whether its forward writes state in place
    (planner.model.running_stats) and whether it passes on a view of its parameter
    (planner.model.parameter_views)."""
    param_bytes, trainable = unit_parameter_bytes(module.parameters())
    return UnitProfile(name=unit.name, param_bytes=param_bytes, trainable_bytes=trainable, forward_s={},
                       backward_s={}, saved_bytes={}, output_bytes={}, nodes=[n.name for n in unit.nodes],
                       buffer_bytes=sum(tensor_bytes(b) for b in module.buffers() if b.is_floating_point())
                       if buffers else None,
                       running_stats=writes_state, parameter_view=parameter_view)
