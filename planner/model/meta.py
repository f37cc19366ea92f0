"""Building a model without its storage: parameters made on the meta device, a built model moved
there (runtime.initstate materialises a rank's stages from a file; a bf16-mixed profile's graph
takes its casts from a meta copy, planner.model.casts)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter, is_lazy


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device (no storage, no initialisation
    cost) and their buffers where they are made."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and param.device.type != "meta":
            param = _lazy_on_meta(param) if is_lazy(param) else \
                nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _lazy_on_meta(param: nn.Parameter) -> nn.Parameter:
    """A lazy module's parameter (no shape yet) as one made on meta: the forward that gives it its
    shape (planner.model.entry.materialize_lazy) then makes it there, without storage."""
    return UninitializedParameter(requires_grad=param.requires_grad, device="meta", dtype=param.dtype)


def to_meta(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Move the whole model to meta; returns the buffers' real values by name (the file may not
    hold them: non-persistent buffers are computed when the model is built)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers(remove_duplicate=False)
               if b.device.type != "meta"}
    model.to("meta")
    return buffers


def meta_builder(entry: str, model_args: Mapping[str, Any], seed: int) -> Callable[[], nn.Module]:
    """A function building the model from its entry point with every parameter and buffer on meta
    (planner.model.casts.recast builds it so, for its second export)."""
    from planner.model.entry import build_spec

    def build() -> nn.Module:
        with parameters_on_meta():
            module = build_spec(entry, dict(model_args), seed).module
        to_meta(module)
        return module
    return build
