"""Capture a model's graph with torch.fx and group it into ordered partition units.

A unit is a maximal run of graph nodes (in execution order) that belong to the same
top-level submodule call; containers (`nn.Sequential`, `nn.ModuleList`, `nn.ModuleDict`) are
looked through, so a transformer block or a residual block is one unit. Free operations
between submodule calls join the unit before them (leading ones the first unit).

Cut k (1 <= k < L) sits just before unit k. The values crossing it are the nodes produced in
a unit < k and consumed in a unit >= k (the model's output counts as consumed after the last
unit). Model inputs never cross: every rank rebuilds the batch itself. Parameters and buffers
(`get_attr` nodes) never cross either: each stage reads its own.

`CapturedModel.stage_module(first, end)` cuts units [first, end) out as an `fx.GraphModule`
whose forward takes (model inputs used, values crossing cut `first`) and returns the values
crossing cut `end` (or the model output for the last stage). Submodules keep their original
qualified names, so a stage's `state_dict` keys are the model's own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx, nn

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class CaptureError(RuntimeError):
    """The model cannot be captured as a graph. The message names the cause and a way out."""


class _UnitTracer(fx.Tracer):
    """A symbolic tracer that tags every node with the stack of module paths it was created in."""

    def __init__(self) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True  # buffers become get_attr nodes, read per stage
        self.unit_module_stack: List[str] = []

    def call_module(self, m, forward, args, kwargs):
        self.unit_module_stack.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.unit_module_stack.pop()

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        node.meta["module_stack"] = list(self.unit_module_stack)
        return node


@dataclass
class Unit:
    name: str
    nodes: List[fx.Node] = field(default_factory=list)


@dataclass
class StageIO:
    """The signature of a stage module: what it takes and what it returns, by node name."""

    inputs: List[str]  # model input names used by the stage, in the model's order
    received: List[str]  # values crossing the stage's first cut, in graph order
    sent: List[str]  # values crossing its end cut, in graph order (empty for the last stage)
    is_last: bool


def _unit_path(root: nn.Module, stack: List[str]) -> Optional[str]:
    """The partition key of a node: its outermost module call, looking through containers."""
    if not stack:
        return None
    depth = 0
    path = stack[0]
    while depth + 1 < len(stack) and isinstance(root.get_submodule(path), _CONTAINERS):
        depth += 1
        path = stack[depth]
    return path


class CapturedModel:
    """A traced model, its units, and the values crossing each cut."""

    def __init__(self, module: nn.Module):
        self.module = module
        tracer = _UnitTracer()
        try:
            graph = tracer.trace(module)
        except Exception as e:  # fx raises many types; all mean "not symbolically traceable"
            raise CaptureError(
                f"torch.fx could not trace {type(module).__name__}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}. Make data-dependent code a leaf module "
                "or avoid Python control flow on tensor values") from None
        self.gm = fx.GraphModule(module, graph, class_name=type(module).__name__)
        self.placeholders = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.units = self._group_units(module)
        self._unit_of: Dict[str, int] = {}
        for index, unit in enumerate(self.units):
            for node in unit.nodes:
                self._unit_of[node.name] = index
        self._crossing = self._compute_crossings()

    # --- grouping -----------------------------------------------------------------------
    def _group_units(self, root: nn.Module) -> List[Unit]:
        compute = [n for n in self.gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
        if not compute:
            raise CaptureError(f"{type(root).__name__} has no operations to partition")
        keys = [_unit_path(root, n.meta.get("module_stack", [])) for n in compute]
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

    def _compute_crossings(self) -> List[List[fx.Node]]:
        """crossing[k] = nodes produced in a unit < k and consumed in a unit >= k (k = 0..L)."""
        L = len(self.units)
        last_use: Dict[fx.Node, int] = {}
        for node in self.gm.graph.nodes:
            consumer = L if node.op == "output" else self._unit_of.get(node.name)
            if consumer is None:
                continue
            for source in node.all_input_nodes:
                if source.name in self._unit_of:
                    last_use[source] = max(last_use.get(source, -1), consumer)
        crossing: List[List[fx.Node]] = [[] for _ in range(L + 1)]
        for node in self.gm.graph.nodes:  # graph order gives a canonical order per cut
            produced = self._unit_of.get(node.name)
            if produced is None or node not in last_use:
                continue
            for k in range(produced + 1, last_use[node] + 1):
                crossing[k].append(node)
        return crossing

    # --- queries ------------------------------------------------------------------------
    @property
    def unit_names(self) -> List[str]:
        return [u.name for u in self.units]

    def crossing(self, k: int) -> List[fx.Node]:
        """Values crossing cut k (the boundary before unit k); k = L means the model's end."""
        return list(self._crossing[k])

    def unit_index(self, name: str) -> int:
        for i, unit in enumerate(self.units):
            if unit.name == name:
                return i
        raise KeyError(name)

    def stage_io(self, first: int, end: int) -> StageIO:
        nodes = [n for u in self.units[first:end] for n in u.nodes]
        used_inputs = {s.name for n in nodes for s in n.all_input_nodes if s.op == "placeholder"}
        if end == len(self.units):
            output = next(n for n in self.gm.graph.nodes if n.op == "output")
            used_inputs |= {s.name for s in output.all_input_nodes if s.op == "placeholder"}
        return StageIO(
            inputs=[p for p in self.placeholders if p in used_inputs],
            received=[n.name for n in self._crossing[first]] if first > 0 else [],
            sent=[n.name for n in self._crossing[end]] if end < len(self.units) else [],
            is_last=end == len(self.units),
        )

    def stage_module(self, first: int, end: int) -> Tuple[fx.GraphModule, StageIO]:
        """Units [first, end) as a GraphModule: forward(*inputs, *received) -> tuple(sent) or model output."""
        if not 0 <= first < end <= len(self.units):
            raise ValueError(f"bad unit range [{first}, {end}) for {len(self.units)} units")
        io = self.stage_io(first, end)
        graph = fx.Graph()
        env: Dict[fx.Node, fx.Node] = {}
        by_name = {n.name: n for n in self.gm.graph.nodes}
        for name in io.inputs + io.received:
            env[by_name[name]] = graph.placeholder(name)

        def lookup(node: fx.Node) -> fx.Node:
            if node not in env:
                if node.op != "get_attr":
                    raise CaptureError(f"stage [{first}, {end}) needs {node.name!r}, which does not reach it")
                env[node] = graph.node_copy(node)  # parameters and buffers are read where used
            return env[node]

        for unit in self.units[first:end]:
            for node in unit.nodes:
                for source in node.all_input_nodes:
                    lookup(source)
                env[node] = graph.node_copy(node, lookup)
        if io.is_last:
            output = next(n for n in self.gm.graph.nodes if n.op == "output")
            for source in output.all_input_nodes:
                lookup(source)
            graph.output(fx.map_arg(output.args[0], lookup))
        else:
            graph.output(tuple(env[by_name[name]] for name in io.sent))
        graph.lint()
        stage = fx.GraphModule(self.gm, graph, class_name=f"Stage_{first}_{end}")
        return stage, io

    def parameter_names(self, first: int, end: int) -> List[str]:
        """Original names of the parameters units [first, end) use."""
        stage, _ = self.stage_module(first, end)
        return [name for name, _ in stage.named_parameters()]


def capture(module: nn.Module) -> CapturedModel:
    return CapturedModel(module)


def run_all_nodes(captured: CapturedModel, inputs: tuple, grad: bool = False) -> Dict[str, Any]:
    """Run the traced model once, returning every node's value by name (for measuring units).

    With `grad=True` autograd records the run, so each value's `requires_grad` is meaningful."""
    values: Dict[str, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            values[n.name] = result
            return result

    with torch.set_grad_enabled(grad):
        _Recorder(captured.gm).run(*inputs)
    return values
