"""Capture a model's graph (torch.fx, else torch.export) and group it into ordered partition units.

`torch.fx.symbolic_trace` is tried first; when it fails (Python control flow on shapes or values, library
code), `torch.export` captures the model on an example batch (capture_export.py). Both give an FX graph whose
nodes carry `meta["module_stack"]`. A unit is a maximal run of graph nodes (in execution order) that belong to
the same top-level submodule call, looking through containers and stacks of repeated layers
(planner/model/units.py); the fx tracer and what it refuses are planner/model/fx_trace.py.

In-place operations: a unit boundary never falls between a tensor's producer and an operation writing
into it or a view of it (an `nn.ReLU(inplace=True)` unit joins the unit of the tensor it overwrites:
`CapturedModel.merges`; planner/model/inplace.py), so no stage writes into a tensor it received. The fx
tracer records `a += b` in place (`augmented_assign`), as eager PyTorch runs it.

Values whose shape depends on the data (the tokens a mixture of experts routes to each expert) never cross a
cut either: the units from maker to last reader are joined (`CapturedModel.shape_merges`; dynamic_shapes.py).

Cut k (1 <= k < L) sits just before unit k. The values crossing it are the nodes produced in
a unit < k and consumed in a unit >= k (the model's output counts as consumed after the last
unit). Model inputs never cross: every rank rebuilds the batch itself. Parameters and buffers
(`get_attr` nodes) never cross either: each stage reads its own. Nor do values computed from
inputs, buffers and constants alone (an attention mask, position ids, rotary tables): each stage
reading one computes it again (planner/model/recomputable.py states the rule).

`CapturedModel.stage_module(first, end)` cuts units [first, end) out as a stage's graph module
(planner/model/stage_graph.py).
"""
from __future__ import annotations

import inspect
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from planner.errors import CaptureError  # noqa: F401  (defined without torch: the CLI catches it)
from planner.model.capture_export import ExportFailure, export_graph, split_inputs, torch_quiet
from planner.model.dynamic_shapes import data_sized_nodes, data_sizes_across_units
from planner.model.failures import NodeRunError, eager_failure, first_line
from planner.model.example import EXAMPLE_BATCH_SIZE, example_batch, filled_varargs, none_arguments
from planner.model.fx_trace import Unpipelinable, refuse_reserved_names, trace_fx
from planner.model.inplace import writes_across_units
from planner.model.recomputable import recomputable_nodes
from planner.model.stage_graph import StageIO, stage_io, stage_module
from planner.model.trace_state import PythonState
from planner.model.units import group_units, joined

@dataclass
class SharedParameter:
    """One parameter tensor read by several units (tied weights), under all of its names."""

    name: str  # the model's first name for it (named_parameters order)
    names: List[str]  # every state_dict name of the tensor
    units: List[str]  # units reading it
    bytes: int
    trainable: bool = True  # requires_grad: a frozen tied weight has no gradient to sum across its holders


class CapturedModel:
    """A captured model, its units, and the values crossing each cut.

    `method` is "fx" or "export". For "auto", fx is tried first and export on failure; export
    needs an example batch: `example_inputs`, or the batch function of the `ModelSpec` that
    built `module` (recorded by `planner.model.spec.build_spec`).
    """

    def __init__(self, module: nn.Module, example_inputs: Any = None, method: str = "auto"):
        self.module = module
        self.in_spec: Any = None  # export only: pytree spec of (args, kwargs)
        self.out_spec: Any = None  # export only: pytree spec of the model's output
        self.forward_sets: List[str] = []  # export only: attributes forward assigns (planner.model.forward_state)
        self.fallback_reason = ""  # why fx was not used, when export was
        self.fixed_batch: Optional[int] = None  # export only: the one batch size the graph runs
        if method not in ("auto", "fx", "export"):
            raise ValueError(f"capture method {method!r} is not auto, fx or export")
        # the forward's arguments the example batch leaves None: fx traces them as None (input_values
        # refuses a batch giving one)
        example = example_inputs if example_inputs is not None else example_batch(module)
        self.traced_as_none: Set[str] = set() if method == "export" else none_arguments(module, example)
        before = PythonState(module)
        try:
            self._capture(module, example, method)
        except BaseException:
            before.put_back()  # the user's model as it was, whatever the trace changed
            raise
        first = dict(vars(self))
        fixed = before.changed(lambda: self._capture(module, example, method), first["gm"])
        vars(self).update(first)  # the first trace's graph and fields, not the second's
        if fixed:
            raise CaptureError(f"cannot capture {type(module).__name__}: {fixed}")
        self.placeholders = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        # the forward's own argument names: fx renames a placeholder that shadows a builtin
        # (nn.Sequential's `input` becomes node `input_1`), its target keeps the argument's name
        self._arguments = [str(n.target).lstrip("*") for n in self.gm.graph.nodes if n.op == "placeholder"]
        if self.method == "fx":  # a placeholder traced as None is renamed (bias_1): its argument's name
            self._arguments = [next((name for name in self.traced_as_none if re.fullmatch(f"{name}_[0-9]+", target)),
                                    target) for target in self._arguments]
        self.recomputed = recomputable_nodes(self.gm)  # never cross: recomputed where read
        units = group_units(self.gm, module)
        self.merges = writes_across_units(self.gm, [u.nodes for u in units], [u.name for u in units])
        units = joined(units, self.merges)
        # the nodes whose values' shapes the data sets (a routed block's rows): kept inside units
        self.data_sized: Set[str] = data_sized_nodes(self.gm, self.method, self.input_values(example)
                                                     if self.method == "fx" and example is not None else None)
        self.shape_merges = data_sizes_across_units(self.gm, [u.nodes for u in units], [u.name for u in units],
                                                    self.data_sized, self.recomputed)
        self.units = joined(units, self.shape_merges)
        self._unit_of: Dict[str, int] = {}
        for index, unit in enumerate(self.units):
            for node in unit.nodes:
                self._unit_of[node.name] = index
        self._crossing = self._compute_crossings()

    def _capture(self, module: nn.Module, example: Any, method: str) -> fx.GraphModule:
        """The graph (also `self.gm`): torch.fx, or torch.export where fx cannot take the model (or `method`
        says)."""
        fx_error = None
        refuse_reserved_names(module)  # `self.code = nn.Parameter(...)`: fx and torch.export both fail on it
        with torch_quiet():  # a failure is one CaptureError line, not torch's graph dump and warnings
            if method in ("auto", "fx"):
                try:
                    varargs = filled_varargs(module, example)
                    if varargs:  # fx makes *args one placeholder: the batch's values would not reach it
                        raise CaptureError(f"forward's *{varargs} takes the batch's values, which torch.fx traces "
                                           "as one")
                    self.gm, self.method = trace_fx(module, self.traced_as_none), "fx"
                except Unpipelinable:  # no graph would do: torch.export is not tried
                    raise
                except CaptureError as e:
                    if method == "fx":
                        raise
                    fx_error = e
            if method == "export" or fx_error is not None:
                self.gm, self.method = self._export(module, example, fx_error), "export"
                self.fallback_reason = str(fx_error) if fx_error else ""
        return self.gm

    def _export(self, module: nn.Module, example_inputs: Any, fx_error: Optional[CaptureError]) -> fx.GraphModule:
        if example_inputs is None:
            raise CaptureError(f"{fx_error or 'torch.export was asked for'}; torch.export needs an example batch: "
                               "build the model with planner.model.spec.build_spec or pass example_inputs")
        try:
            exported = export_graph(module, example_inputs)
        except CaptureError as e:  # something the exported graph would leave out
            raise CaptureError(f"cannot capture {type(module).__name__}: {fx_error or 'torch.export was asked for'}; "
                               f"{e}") from None
        except ExportFailure as e:
            eager = eager_failure(module, example_inputs)
            if eager is not None:  # not a capture problem: the model's own code raises on its example batch
                raise eager from None
            where = f" in {e.module_path!r}" if e.module_path else ""
            raise CaptureError(
                f"cannot capture {type(module).__name__}: {fx_error or 'torch.export was asked for'}; torch.export "
                f"failed{where}: {first_line(e.cause)}. Way out: in that module, {e.way_out()}") from None
        self.in_spec, self.out_spec, self.fixed_batch = exported.in_spec, exported.out_spec, exported.fixed_batch
        self.forward_sets = exported.forward_sets
        return exported.gm

    def output_of(self, values: Dict[str, Any]) -> Any:
        """The model's output, as its forward returns it, from `run_all_nodes`' values."""
        out = values[next(n.name for n in self.gm.graph.nodes if n.op == "output")]
        return pytree.tree_unflatten(list(out), self.out_spec) if self.out_spec is not None else out

    def check_batch_size(self, size: int, fix: str) -> None:
        """Refuse a micro-batch size the graph cannot run (export fixed another one); `fix` says what to do."""
        if self.fixed_batch is not None and size != self.fixed_batch:
            raise CaptureError(
                f"torch.export fixed {type(self.module).__name__}'s batch size at {self.fixed_batch} (the model's code "
                f"depends on it, e.g. a Python loop over the samples), so micro-batch size {size} cannot run; {fix}")

    def to(self, device: torch.device) -> "CapturedModel":
        """Move the graph to `device`: its parameters and buffers, and the devices its nodes were
        captured with (torch.export records `arange(..., device=cpu)` and the like: on a GPU they
        would make tensors on the host). Stages cut afterwards run on `device`."""
        self.gm.to(device)
        return self.place_nodes(device)

    def place_nodes(self, device: torch.device) -> "CapturedModel":
        """Only the devices the graph's nodes name (its parameters stay where they are): a rank
        moves just its own stages' parameters."""
        device = torch.device(device)

        def moved(value: Any) -> Any:
            if isinstance(value, torch.device):
                return device
            if isinstance(value, (tuple, list)):
                return type(value)(moved(v) for v in value)
            return value

        # the graph and the graphs nested in it (torch.export's higher-order operations, such as
        # wrap_with_set_grad_enabled around a rotary embedding, keep their body as a submodule)
        for graph_module in [m for m in self.gm.modules() if isinstance(m, torch.fx.GraphModule)]:
            for node in graph_module.graph.nodes:
                node.args = moved(node.args)
                node.kwargs = {k: moved(v) for k, v in node.kwargs.items()}
            graph_module.recompile()
        return self

    def input_values(self, inputs: Any) -> List[Any]:
        """A batch's `inputs` (positional, optionally ending in a keyword dict) as a list aligned
        with `placeholders`: what the graph's forward takes."""
        args, kwargs = split_inputs(inputs)
        if self.method == "export":
            return list(fx_pytree.tree_flatten_spec((args, kwargs), self.in_spec))
        bound = inspect.signature(self.module.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        given = [name for name in self.traced_as_none if values.get(name) is not None]
        if given:  # the graph took the branch of None: it would ignore the value
            raise CaptureError(f"the model was captured with its argument {given[0]!r} None (as the batch of "
                               f"{EXAMPLE_BATCH_SIZE} at step 0 gives it) and this batch gives a value: batch() must "
                               "give the same arguments at every step")
        return [values[name] for name in self._arguments]

    # --- grouping -----------------------------------------------------------------------
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
            if produced is None or node not in last_use or node.name in self.recomputed:
                continue
            for k in range(produced + 1, last_use[node] + 1):
                crossing[k].append(node)
        return crossing

    # --- edits (planner.model.casts: a graph taking the run's precision) ---------------------------
    def crossing_names(self) -> List[List[str]]:
        """The names crossing every cut, derived again from the graph as it is now."""
        self._crossing = self._compute_crossings()
        return [[n.name for n in cut] for cut in self._crossing]

    def unit_of_node(self, name: str) -> Optional[int]:
        """The unit holding node `name` (None: a placeholder, parameter or the output)."""
        return self._unit_of.get(name)

    def add_to_unit(self, node: fx.Node, unit: int, position: int) -> None:
        """Record a node inserted into the graph as unit `unit`'s, at `position` in its node list."""
        self.units[unit].nodes.insert(position, node)
        self._unit_of[node.name] = unit

    def remove_from_unit(self, node: fx.Node) -> None:
        """Forget a node (about to be erased from the graph) in its unit."""
        self.units[self._unit_of.pop(node.name)].nodes.remove(node)

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
        """What units [first, end) take and return (planner.model.stage_graph)."""
        return stage_io(self, first, end)

    def stage_module(self, first: int, end: int) -> Tuple[fx.GraphModule, StageIO]:
        """Units [first, end) as a GraphModule: forward(*inputs, *received) -> tuple(sent) or model output
        (planner.model.stage_graph)."""
        return stage_module(self, first, end)

    def shared_parameters(self) -> List[SharedParameter]:
        """Parameter tensors read by more than one unit (tied weights), each once: read through a
        get_attr node (by the units using it) or held by a called submodule (a leaf module under fx,
        e.g. an nn.Linear head whose weight is the nn.Embedding's)."""
        names_of: Dict[int, List[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
        units_of: Dict[int, List[str]] = {}
        tensors: Dict[int, torch.Tensor] = {}

        def used(value: nn.Parameter, nodes: List[fx.Node]) -> None:
            tensors[id(value)] = value
            for node in nodes:
                if node.name in self._unit_of:
                    unit = self.units[self._unit_of[node.name]].name
                    if unit not in units_of.setdefault(id(value), []):
                        units_of[id(value)].append(unit)

        for node in self.gm.graph.nodes:
            if node.op == "get_attr":
                value = operator.attrgetter(node.target)(self.gm)
                if isinstance(value, nn.Parameter):
                    used(value, list(node.users))
            elif node.op == "call_module":
                for value in self.gm.get_submodule(node.target).parameters():
                    used(value, [node])
        shared = []
        for key, units in units_of.items():
            if len(units) > 1:
                names = names_of.get(key, [])
                t = tensors[key]
                shared.append(SharedParameter(name=names[0] if names else "", names=names,
                                              units=sorted(units, key=self.unit_index),
                                              bytes=t.numel() * t.element_size(), trainable=t.requires_grad))
        return shared


def capture(module: nn.Module, example_inputs: Any = None, method: str = "auto") -> CapturedModel:
    """fx if it can, torch.export otherwise (see CapturedModel)."""
    return CapturedModel(module, example_inputs, method)


def run_all_nodes(captured: CapturedModel, inputs: Any, grad: bool = False,
                  entering: Optional[Callable[[fx.Node], None]] = None) -> Dict[str, Any]:
    """Run the captured model once on a batch's `inputs`, returning every node's value by name
    (a node that raises: planner.model.failures.NodeRunError, naming it); `entering` is told of each
    node before it runs.

    With `grad=True` autograd records the run, so each value's `requires_grad` is meaningful."""
    values: Dict[str, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            if entering is not None:
                entering(n)
            try:
                result = super().run_node(n)
            except Exception as e:  # the model's own error, whatever its type: say where it came from
                raise NodeRunError(n, e) from e
            values[n.name] = result
            return result

    with torch.set_grad_enabled(grad):
        _Recorder(captured.gm).run(*captured.input_values(inputs))
    return values
