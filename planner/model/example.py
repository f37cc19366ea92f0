"""The example batch a capture runs on, and which of forward's arguments it fills.

torch.export needs an example batch: `planner.model.spec.build_spec` records the ModelSpec's batch
function for its module (`remember_batch`), and capture takes one batch of EXAMPLE_BATCH_SIZE from
it. torch.fx traces forward's arguments symbolically, so two things about the batch matter to it:
an argument the batch leaves None is traced as None (the branch the batches take), and values in
forward's `*args` would be traced as one placeholder (capture then exports).
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, List, Set, Tuple

from torch import nn

from planner.model.capture_export import split_inputs


# The batch function of the ModelSpec that built each module (export needs an example batch).
_EXAMPLE_BATCHES: "weakref.WeakKeyDictionary[nn.Module, Callable]" = weakref.WeakKeyDictionary()
EXAMPLE_BATCH_SIZE = 2  # dynamic batch dimensions must not be 0 or 1 when exported


def remember_batch(module: nn.Module, batch: Callable) -> None:
    """Record `batch(batch_size, step)` for `module`, so capture can export it on an example."""
    _EXAMPLE_BATCHES[module] = batch


def example_batch(module: nn.Module) -> Any:
    batch = _EXAMPLE_BATCHES.get(module)
    return batch(EXAMPLE_BATCH_SIZE, 0)[0] if batch is not None else None


def _example_arguments(module: nn.Module, example_inputs: Any) -> List[Tuple[str, Any, Any]]:
    """[(name, value, kind)] of forward's arguments, defaults applied, for the example batch; [] when
    there is none or it does not fit the signature (fx's own error then says so)."""
    if example_inputs is None:
        return []
    signature = inspect.signature(module.forward)
    try:
        args, kwargs = split_inputs(example_inputs)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return []
    bound.apply_defaults()
    return [(name, value, signature.parameters[name].kind) for name, value in bound.arguments.items()]


def none_arguments(module: nn.Module, example_inputs: Any) -> Set[str]:
    """The forward's arguments the example batch leaves None (passed or by default): fx traces them as
    None (`concrete_args`), so `if mask is not None:` takes the branch the batches take."""
    return {name for name, value, kind in _example_arguments(module, example_inputs)
            if value is None and kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def filled_varargs(module: nn.Module, example_inputs: Any) -> str:
    """The name of forward's `*args` when the example batch gives it values ("" otherwise)."""
    return next((name for name, value, kind in _example_arguments(module, example_inputs)
                 if kind == inspect.Parameter.VAR_POSITIONAL and value), "")
