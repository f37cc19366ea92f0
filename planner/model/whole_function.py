"""A custom autograd Function kept whole in a torch.export graph.

torch.export traces through a custom `torch.autograd.Function`'s forward and keeps its operations,
not the Function: the graph's backward would be autograd's derivative of those operations, not the
Function's own backward (a straight-through estimator, a fused GELU's hand-written derivative). Under
capture, each such call becomes one node of the custom operator `planner::autograd_function`, which
runs the Function itself:

- forward: the Function's forward on the call's tensors, under no_grad;
- backward: the forward again from the saved inputs, with gradients, and the Function's backward
  through it (autograd.grad), so the gradients are the Function's own; the price is one more forward
  of the call, and its inputs held for the backward;
- fake and meta tensors: the Function's forward on them gives the outputs' shapes.

The call's other arguments (numbers, strings, dtypes) are constants of the node, kept with the
Function under a key the graph names (`register`): every process that captures the model registers
its calls (the ranks capture it themselves). What cannot be kept so stops the capture in one line:
a traced size passed as an argument (its value changes with the batch), a function or module passed
in (its parameters would be no stage's), an output that is neither a tensor nor None. A Function
writing into its inputs, or drawing random numbers (the backward's second forward would draw
others), is refused where the graph first runs (the profile's first batch).
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from planner.errors import CaptureError

_APPLY = torch.autograd.Function.apply.__func__  # the unpatched apply (capture patches it while tracing)
_CONSTANTS = (bool, int, float, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device,
              torch.memory_format, torch.layout)


class _Tensor:
    """Where a tensor argument goes in a call's flattened arguments."""

    def __repr__(self) -> str:
        return "<tensor>"


_SLOT = _Tensor()


class _Call:
    """One kind of call: the Function, its arguments' structure and constants; whether it returns one
    tensor, and where its outputs are None (the operator returns the tensors alone)."""

    def __init__(self, function: type, spec: Any, leaves: List[Any]):
        self.function, self.spec, self.leaves = function, spec, leaves
        self.single, self.absent = True, []

    def arguments(self, tensors: Sequence[torch.Tensor]) -> Tuple[tuple, dict]:
        given = iter(tensors)
        return pytree.tree_unflatten([next(given) if leaf is _SLOT else leaf for leaf in self.leaves], self.spec)

    def outputs(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The Function's forward on these tensors (no copy): its tensor outputs as a list."""
        args, kwargs = self.arguments(tensors)
        out = _APPLY(self.function, *args, **kwargs)
        self.single = not isinstance(out, (tuple, list))
        outs = [out] if self.single else list(out)
        if not all(isinstance(o, torch.Tensor) or o is None for o in outs):
            raise CaptureError(f"the custom autograd Function {self.function.__name__} returns something other than "
                               "tensors, which an exported graph cannot keep as one call")
        self.absent = [o is None for o in outs]
        return [o for o in outs if o is not None]

    def returned(self, tensors: Sequence[torch.Tensor]) -> Any:
        """What apply returns, from the operator's tensors."""
        given = iter(tensors)
        outs = [None if absent else next(given) for absent in self.absent]
        return outs[0] if self.single else tuple(outs)


_CALLS: Dict[str, _Call] = {}


def register(function: type, args: tuple, kwargs: dict) -> Tuple[str, List[torch.Tensor]]:
    """The key of this call's kind and its tensor arguments; CaptureError where the call cannot be kept."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors, kept = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            kept.append(_SLOT)
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise CaptureError(f"forward passes a size of a tensor to the custom autograd Function "
                               f"{function.__name__}, which an exported graph would fix at the example's value")
        elif isinstance(leaf, _CONSTANTS):
            kept.append(leaf)
        else:
            raise CaptureError(f"forward passes a {type(leaf).__name__} to the custom autograd Function "
                               f"{function.__name__}, which an exported graph cannot keep as one call")
    # the class object itself (two classes may share a name: made by a factory, or defined again), kept
    # alive by its entry so that its id is never another's; the graph and its key are this process's own
    digest = hashlib.sha1(f"{kept!r}{spec!r}".encode()).hexdigest()[:12]  # the constants and structure
    key = f"{function.__module__}.{function.__qualname__}@{id(function):x}#{digest}"
    if key not in _CALLS:
        _CALLS[key] = _Call(function, spec, kept)
    return key, tensors


def whole_apply(function: type, args: tuple, kwargs: dict) -> Any:
    """`function.apply(*args, **kwargs)` as one node of the graph being exported."""
    key, tensors = register(function, args, kwargs)
    return _CALLS[key].returned(autograd_function(key, tensors))


def kept_whole(gm: Any) -> Dict[str, int]:
    """The custom Functions an exported graph keeps whole: class name -> calls."""
    counts: Dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.planner.autograd_function.default:
            name = _call(node.args[0]).function.__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


def _call(key: str) -> _Call:
    if key not in _CALLS:
        raise CaptureError(f"the graph calls a custom autograd Function ({key.split('@')[0]}) this process never "
                           "captured; capture the model in this process before running its graph")
    return _CALLS[key]


@torch.library.custom_op("planner::autograd_function", mutates_args=())
def autograd_function(key: str, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    call = _call(key)
    versions, rng = [t._version for t in tensors], _generators(tensors)
    with torch.no_grad():
        outs = call.outputs(tensors)
    if [t._version for t in tensors] != versions:
        raise CaptureError(f"the custom autograd Function {call.function.__name__} writes into its inputs, which an "
                           "exported graph cannot keep as one call")
    if any(not torch.equal(now, before) for now, before in zip(_generators(tensors), rng)):
        raise CaptureError(f"the custom autograd Function {call.function.__name__} draws random numbers, so the "
                           "second forward its backward runs would differ from the first")
    return _unaliased(outs, tensors)


def _unaliased(outs: List[torch.Tensor], tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """An operator's outputs may not alias its inputs: a view or an input returned is copied."""
    return [o.clone() if o._is_view() or any(o is t for t in tensors) else o for o in outs]


def _generators(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The states of the random generators the call may draw from: the host's, and its tensors' GPUs'."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(device) for device in sorted(devices, key=str)]


@autograd_function.register_fake
def _shapes(key: str, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    with torch.no_grad():
        outs = _call(key).outputs(tensors)
    return _unaliased(outs, tensors)


def _setup_context(ctx, inputs, output) -> None:
    key, tensors = inputs
    ctx.key = key
    ctx.autocast = _autocast_state()  # the forward's: its second run in backward computes the same
    ctx.save_for_backward(*tensors)


def _autocast_state() -> List[Tuple[str, bool, torch.dtype]]:
    return [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")]


def _backward(ctx, grads):
    tensors = ctx.saved_tensors
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensors]
        with contextlib.ExitStack() as modes:  # the forward under its autocast, the backward as the caller's
            for device, enabled, dtype in ctx.autocast:
                modes.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            outs = _call(ctx.key).outputs(inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        wanted = [t for t in inputs if t.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
            if pairs and wanted else [None] * len(wanted)
    given = iter(got)
    return None, [next(given) if t.requires_grad else None for t in inputs]


autograd_function.register_autograd(_backward, setup_context=_setup_context)
