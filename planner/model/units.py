"""Partition units: which graph nodes form one unit of the model.

A unit is a maximal run of graph nodes (in execution order) that belong to the same top-level
submodule call. Containers (`nn.Sequential`, `nn.ModuleList`, `nn.ModuleDict`) and "stacks"
(modules holding a list of layers somewhere below them, like a Hugging Face `LlamaModel` or
`T5Stack`: layers of one type, of one kind as a hybrid model's are, or a ModuleList of one layer)
are looked through, so a transformer block or a residual block is one unit. Free operations between
submodule calls join the unit before them (leading ones the first unit).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from torch import fx, nn

from planner.errors import CaptureError
from planner.model.inplace import Merge

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass
class Unit:
    name: str
    nodes: List[fx.Node] = field(default_factory=list)


def _is_repeated_list(module: nn.Module) -> bool:
    """A container of two or more layers of one type, or of one kind (their classes share a base of
    the model's code, as a hybrid model's attention and state-space layers do), or a ModuleList of one
    layer of the model's code: the layer list of a stack."""
    if not isinstance(module, _CONTAINERS):
        return False
    types = [type(child) for child in module.children()]
    if len(types) == 1:  # a layer list of one layer (a one-layer encoder's `layers`), not a block's part
        return isinstance(module, nn.ModuleList) and not types[0].__module__.startswith("torch")
    if not types:
        return False
    return len(set(types)) < len(types) or bool(set.intersection(*(_own_bases(t) for t in types)))


def _own_bases(cls: type) -> set:
    """The classes `cls` derives from that are not torch's (nor `object`)."""
    return {base for base in cls.__mro__ if not base.__module__.startswith(("torch", "builtins"))}


def _looked_through(module: nn.Module) -> bool:
    """Containers, and modules with a repeated layer list below them (a model wrapper, a stack)."""
    if isinstance(module, _CONTAINERS):
        return True
    return any(_is_repeated_list(m) for m in module.modules() if m is not module)


def _unit_path(root: nn.Module, stack: List[str], cache: Dict[str, bool]) -> Optional[str]:
    """The partition key of a node: its outermost module call, looking through containers and
    stacks; None for a node directly inside a looked-through module (a free operation)."""
    for path in stack:
        if path not in cache:
            cache[path] = _looked_through(root.get_submodule(path))
        if not cache[path]:
            return path
    return None


def group_units(gm: fx.GraphModule, root: nn.Module) -> List[Unit]:
    """The graph's compute nodes in maximal runs of one unit path (`_unit_path`), free operations
    joining the unit before them."""
    compute = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    if not compute:
        raise CaptureError(f"{type(root).__name__} has no operations to partition")
    cache: Dict[str, bool] = {}
    keys = [_unit_path(root, n.meta.get("module_stack", []), cache) for n in compute]
    # Free operations join the unit before them; leading free operations join the first unit.
    first_key = next((k for k in keys if k is not None), "ops")
    previous = first_key
    for i, key in enumerate(keys):
        if key is None:
            keys[i] = previous
        previous = keys[i]
    units: List[Unit] = []
    seen: Dict[str, int] = {}
    last_key = object()
    for node, key in zip(compute, keys):
        if key != last_key:
            seen[key] = seen.get(key, 0) + 1
            name = key if seen[key] == 1 else f"{key}#{seen[key]}"
            units.append(Unit(name))
            last_key = key
        units[-1].nodes.append(node)
    return units


def joined(units: List[Unit], merges: List[Merge]) -> List[Unit]:
    """`units` with each merge's range joined into one unit, named after its first."""
    joined, k = [], 0
    for merge in merges:
        joined += units[k:merge.first]
        joined.append(Unit(merge.kept, [n for u in units[merge.first:merge.last + 1] for n in u.nodes]))
        k = merge.last + 1
    return joined + units[k:]
