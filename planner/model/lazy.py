"""Lazy modules (nn.LazyLinear, nn.LazyConv2d, ...): their parameters made where every command builds
the model (planner.model.entry.build_spec), as their first forward would make them, the same in every
process that builds it with one seed."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedBuffer, is_lazy
from torch.utils._pytree import tree_map_only

from planner.model.failures import first_line
from planner.model.spec import ModelEntryError, ModelSpec, call_model

LAZY_BATCH_SIZE = 2  # the batch the forward that makes lazy parameters runs on: spec.batch(2, 0)


def materialize_lazy(spec: ModelSpec, entry: str) -> None:
    """Give lazy modules (nn.LazyLinear, ...) their parameters, as their first forward would: one forward
    of `spec.batch(2, 0)` under no_grad, after which every buffer holds its value from before it (a lazy
    one its value as made: BatchNorm's statistics do not move) and the random state is the one the
    model function left (what a run's random streams continue). Every process building the model with
    one seed thus makes the same parameters. A model built with its parameters on meta runs that forward
    on meta. A forward that fails, or leaves a module lazy, is a ModelEntryError."""
    if not _lazy_owners(spec.module):
        return
    device = _forward_device(spec.module)
    # the random state the model function left (making a lazy parameter draws its initial values)
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    restore_buffers = _keep_buffers(spec.module, device)
    try:
        inputs = spec.batch(LAZY_BATCH_SIZE, 0)[0]
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            call_model(spec.module, tree_map_only(torch.Tensor, lambda t: t.to(device), inputs))
    except Exception as e:  # noqa: BLE001 - the model's own forward (PLANNER_TRACEBACK=1: where)
        if os.environ.get("PLANNER_TRACEBACK"):
            raise
        lazy = ", ".join(_lazy_owners(spec.module))
        raise ModelEntryError(f"{entry}: the forward that gives its lazy modules ({lazy}) their parameters "
                              f"failed on batch({LAZY_BATCH_SIZE}, 0): {first_line(e)}; "
                              "fix the model or batch(), or give those modules their sizes (nn.Linear for "
                              "nn.LazyLinear)") from None
    finally:
        restore_buffers()
    left = _lazy_owners(spec.module)
    if left:
        raise ModelEntryError(f"{entry}: lazy module(s) {', '.join(left)} got no parameters from a forward of "
                              f"batch({LAZY_BATCH_SIZE}, 0) (it never calls them); give them their sizes or "
                              "remove them")


def _lazy_owners(module: torch.nn.Module) -> List[str]:
    """The names of the modules holding an uninitialized parameter or buffer ("model" for the root)."""
    return [name or "model" for name, m in module.named_modules()
            if any(is_lazy(t) for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)]


def _forward_device(module: torch.nn.Module) -> torch.device:
    """Where the lazy forward runs: meta where any made parameter is on meta (a model built without
    storage), else the device of the model's first made tensor (of its first lazy one if none is made)."""
    tensors = [*module.parameters(), *module.buffers()]
    made = [t for t in tensors if not is_lazy(t)]
    if any(t.device.type == "meta" for t in made):
        return torch.device("meta")
    return (made or tensors)[0].device


def _keep_buffers(module: torch.nn.Module, device: torch.device) -> Callable[[], None]:
    """Remember every buffer's value, and a lazy buffer's once its module made it (a forward pre-hook,
    after the lazy module's own); returns what puts each back, the same tensor object under its name.
    On meta, the forward sees meta copies of the real buffers (a meta parameter cannot meet them)."""
    kept: Dict[Tuple[int, str], Tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = {}

    def keep(m: torch.nn.Module, *_: Any) -> None:
        for name, b in m._buffers.items():
            if b is not None and not is_lazy(b) and (id(m), name) not in kept:
                kept[(id(m), name)] = (m, name, b, b.detach().clone())

    for m in module.modules():
        keep(m)
    hooks = [m.register_forward_pre_hook(keep) for m in module.modules()
             if isinstance(m, LazyModuleMixin) or any(is_lazy(b) for b in m._buffers.values() if b is not None)]
    if device.type == "meta":
        _buffers_to_meta(module)

    def restore() -> None:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for m, name, original, value in kept.values():
                m._buffers[name] = original  # a forward may assign a new tensor, or we swapped in a meta one
                original.copy_(value)
    return restore


def _buffers_to_meta(module: torch.nn.Module) -> None:
    """Swap every real buffer for a meta copy (a lazy one for a lazy one on meta), for a forward on meta."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is None or b.device.type == "meta":
                continue
            m._buffers[name] = UninitializedBuffer(device="meta", dtype=b.dtype) if is_lazy(b) else b.to("meta")
