"""Capture a model's graph (torch.fx, else torch.export) and group it into ordered partition units.

`torch.fx.symbolic_trace` is tried first; when it fails (Python control flow on shapes or
values, library code), `torch.export` captures the model on an example batch instead
(capture_export.py). Both give an FX graph whose nodes carry `meta["module_stack"]`.

A unit is a maximal run of graph nodes (in execution order) that belong to the same
top-level submodule call. Containers (`nn.Sequential`, `nn.ModuleList`, `nn.ModuleDict`) and
"stacks" (modules holding a list of repeated layers somewhere below them, like a Hugging Face
`LlamaModel` or `T5Stack`) are looked through, so a transformer block or a residual block is
one unit. Free operations between submodule calls join the unit before them (leading ones the
first unit).

In-place operations: a unit boundary never falls between a tensor's producer and an operation
that writes into it (or into a view of it): such units are joined into one, named after the
first (`CapturedModel.merges` says which and why; rule and details in planner/model/inplace.py). So an
`nn.ReLU(inplace=True)` that is a unit of its own joins the unit of the tensor it overwrites,
and no stage ever writes into a tensor it received. The fx tracer records `a += b` in place
(`augmented_assign`), as eager PyTorch runs it, where fx alone would record `a = a + b`.

Values whose shape depends on the data (the tokens a mixture of experts routes to each expert)
never cross a cut either: the units from the one making such a value to the last one reading it are
joined (`CapturedModel.shape_merges`; rule in planner/model/dynamic_shapes.py).

Cut k (1 <= k < L) sits just before unit k. The values crossing it are the nodes produced in
a unit < k and consumed in a unit >= k (the model's output counts as consumed after the last
unit). Model inputs never cross: every rank rebuilds the batch itself. Parameters and buffers
(`get_attr` nodes) never cross either: each stage reads its own. Nor do values computed from
inputs, buffers and constants alone (an attention mask, position ids, rotary tables): each stage
reading one computes it again (planner/model/recomputable.py states the rule).

`CapturedModel.stage_module(first, end)` cuts units [first, end) out as an `fx.GraphModule`
whose forward takes (model inputs used, values crossing cut `first`) and returns the values
crossing cut `end` (or the model output for the last stage). Submodules keep their original
qualified names, so a stage's `state_dict` keys are the model's own.
"""
from __future__ import annotations

import inspect
import operator
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from planner.errors import CaptureError  # noqa: F401  (defined without torch: the CLI catches it)
from planner.model.capture_export import PATCHING, ExportFailure, export_graph, split_inputs, torch_quiet
from planner.model.dynamic_shapes import data_sized_nodes, data_sizes_across_units
from planner.model.failures import NodeRunError, first_line
from planner.model.inplace import AugmentedProxy, Merge, writes_across_units
from planner.model.recomputable import needed_inputs, recomputable_nodes
from planner.model.trace_state import PythonState, torch_draws

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _modes() -> Tuple[bool, bool, bool, bool]:
    """The autograd and autocast modes an operation runs under (fx records operations, not modes)."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"))


def _hooked(module: nn.Module) -> bool:
    """A module whose call runs hooks: fx, tracing through a module's forward, would drop them."""
    return any(getattr(module, name, None) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


class _UnitTracer(fx.Tracer):
    """A symbolic tracer that tags every node with the stack of module paths it was created in.

    What fx cannot record refuses fx (capture then tries torch.export) instead of tracing a graph
    that computes something else: an operation under another autograd or autocast mode than the
    model's call (`torch.no_grad()`, `set_grad_enabled(False)`, `torch.autocast` inside forward) and
    a hook registered on a tensor inside forward. A module with hooks is called whole (a leaf), so
    its hooks run, and so is a scripted one (torch.jit.script), so its parameters are the stage's; a custom `torch.autograd.Function` is one call too, so its backward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True  # buffers become get_attr nodes, read per stage
        self.unit_module_stack: List[str] = []
        self.failed_at: Optional[str] = None  # innermost module running when tracing failed
        self.modes = _modes()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # a scripted module too: traced through, its compiled forward is called on its C++ object,
        # whose parameters no stage would hold
        return _hooked(m) or isinstance(m, torch.jit.ScriptModule) or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root, concrete_args=None):
        self.modes = _modes()
        if _hooked(root) or any(getattr(torch.nn.modules.module, name, None) for name in (
                "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks")):
            raise CaptureError("the model (or every module, through register_module_*_hook) has hooks, which a "
                               "traced graph would not run")
        tracer = self
        original = torch.autograd.Function.apply.__func__

        def apply(cls, *args, **kwargs):  # a custom Function with a traced argument: one node
            leaves = pytree.tree_leaves((args, kwargs))
            if not any(isinstance(a, fx.Proxy) for a in leaves):
                return original(cls, *args, **kwargs)
            if cls is CheckpointFunction:  # checkpoint(fn, *args) (reentrant): fn's operations, as fx records them
                return args[0](*args[2:])
            if any(callable(a) and not isinstance(a, fx.Proxy) for a in leaves):
                # the call would run code (a module's, say) the graph does not hold: its parameters
                # would be no stage's
                raise CaptureError(f"forward passes a function or module to the custom autograd Function "
                                   f"{cls.__name__}, which torch.fx cannot keep as one call")
            return tracer.create_proxy("call_function", _function_apply(cls), args, kwargs)

        state = [(m, dict(m._buffers), dict(m._parameters), dict(vars(m))) for m in root.modules()
                 if not isinstance(m, torch.jit.ScriptModule)]
        with PATCHING:  # torch patched process-wide: one capture at a time
            torch.autograd.Function.apply = classmethod(apply)
            try:
                graph = super().trace(root, concrete_args)
            finally:
                torch.autograd.Function.apply = classmethod(original)
                assigned = _put_back(state)
        if assigned:
            raise CaptureError(f"forward assigns to the module attribute {assigned!r} (self.{assigned} = ...), which a "
                               "traced graph does not keep")
        return graph

    def call_module(self, m, forward, args, kwargs):
        self.unit_module_stack.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_at is None:
                self.failed_at = self.unit_module_stack[-1]
            raise
        finally:
            self.unit_module_stack.pop()

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if kind not in ("placeholder", "output") and _modes() != self.modes:
            raise CaptureError("an operation runs under another autograd or autocast mode than the model's call "
                               "(torch.no_grad, set_grad_enabled or autocast inside forward), which torch.fx does "
                               "not record")
        if kind == "call_function" and target in (torch.autograd.grad, torch.autograd.backward):
            raise Unpipelinable(f"forward differentiates (torch.autograd.{target.__name__}, a gradient penalty), which "
                               "a pipeline stage cannot: its backward would have to run inside the forward of every "
                               "stage the gradient crosses; compute the penalty outside the pipelined model")
        if kind == "call_method" and target in ("register_hook", "register_post_accumulate_grad_hook"):
            raise CaptureError(f"forward registers a hook on a tensor ({target}), which a captured graph does not keep")
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["module_stack"] = list(self.unit_module_stack)
        return node

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return AugmentedProxy(node, self)  # records `a += b` in place, as eager runs it


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


def _none_arguments(module: nn.Module, example_inputs: Any) -> Set[str]:
    """The forward's arguments the example batch leaves None (passed or by default): fx traces them as
    None (`concrete_args`), so `if mask is not None:` takes the branch the batches take."""
    return {name for name, value, kind in _example_arguments(module, example_inputs)
            if value is None and kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


class Unpipelinable(CaptureError):
    """What no captured graph can run as pipeline stages (torch.export is not tried)."""


def _filled_varargs(module: nn.Module, example_inputs: Any) -> str:
    """The name of forward's `*args` when the example batch gives it values ("" otherwise)."""
    return next((name for name, value, kind in _example_arguments(module, example_inputs)
                 if kind == inspect.Parameter.VAR_POSITIONAL and value), "")


def _put_back(state: List[Tuple[nn.Module, Dict[str, Any], Dict[str, Any], Dict[str, Any]]]) -> str:
    """Put back each buffer, parameter or attribute the trace assigned a traced value to (forward's
    `self.count = self.count + 1` would leave a proxy in the model) as it was before tracing, and
    return the name of one ("" if none)."""
    assigned = ""
    for module, buffers, parameters, attributes in state:
        for store, before in ((module._buffers, buffers), (module._parameters, parameters), (vars(module), attributes)):
            for name in [n for n, value in store.items() if isinstance(value, fx.Proxy)]:
                assigned = assigned or name
                if name in before:
                    store[name] = before[name]
                else:
                    del store[name]
    return assigned


_ASSERT_IS_NONE = getattr(torch.fx._symbolic_trace, "_assert_is_none", None)
_APPLIES: Dict[type, Callable] = {}


def _function_apply(function: type) -> Callable:
    """`function.apply` as a graph node's target: a plain function named after the Function (one
    per class, so that graphs traced twice share it)."""
    if function not in _APPLIES:
        def apply(*args, **kwargs):
            return function.apply(*args, **kwargs)

        apply.__name__ = apply.__qualname__ = f"{function.__name__}_apply"
        apply.autograd_function = function  # what planner.model.dynamic_shapes looks for
        _APPLIES[function] = apply
    return _APPLIES[function]


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


def _is_repeated_list(module: nn.Module) -> bool:
    """A container of two or more layers of one type: the layer list of a stack."""
    if not isinstance(module, _CONTAINERS):
        return False
    types = [type(child) for child in module.children()]
    return len(types) >= 2 and len(set(types)) < len(types)


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
        self.traced_as_none: Set[str] = set() if method == "export" else _none_arguments(module, example)
        before = PythonState(module)
        try:
            self._capture(module, example, method)
        except BaseException:
            before.put_back()  # the user's model as it was, whatever the trace changed
            raise
        fixed = before.changed()
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
        units = self._group_units(module)
        self.merges = writes_across_units(self.gm, [u.nodes for u in units], [u.name for u in units])
        units = _joined(units, self.merges)
        data_sized = data_sized_nodes(self.gm, self.method, self.input_values(example)
                                      if self.method == "fx" and example is not None else None)
        self.shape_merges = data_sizes_across_units(self.gm, [u.nodes for u in units], [u.name for u in units],
                                                    data_sized, self.recomputed)
        self.units = _joined(units, self.shape_merges)
        self._unit_of: Dict[str, int] = {}
        for index, unit in enumerate(self.units):
            for node in unit.nodes:
                self._unit_of[node.name] = index
        self._crossing = self._compute_crossings()

    def _capture(self, module: nn.Module, example: Any, method: str) -> None:
        """The graph: torch.fx, or torch.export where fx cannot take the model (or `method` says)."""
        fx_error = None
        with torch_quiet():  # a failure is one CaptureError line, not torch's graph dump and warnings
            if method in ("auto", "fx"):
                try:
                    varargs = _filled_varargs(module, example)
                    if varargs:  # fx makes *args one placeholder: the batch's values would not reach it
                        raise CaptureError(f"forward's *{varargs} takes the batch's values, which torch.fx traces "
                                           "as one")
                    self.gm, self.method = self._trace_fx(module, self.traced_as_none), "fx"
                except Unpipelinable:  # no graph would do: torch.export is not tried
                    raise
                except CaptureError as e:
                    if method == "fx":
                        raise
                    fx_error = e
            if method == "export" or fx_error is not None:
                self.gm, self.method = self._export(module, example, fx_error), "export"
                self.fallback_reason = str(fx_error) if fx_error else ""

    # --- capture ------------------------------------------------------------------------
    @staticmethod
    def _trace_fx(module: nn.Module, as_none: Set[str]) -> fx.GraphModule:
        tracer = _UnitTracer()
        try:
            with torch_draws():
                graph = tracer.trace(module, {name: None for name in as_none} or None)
            for node in [n for n in graph.nodes if n.target is _ASSERT_IS_NONE and not n.users]:
                graph.erase_node(node)  # concrete_args' check: a stage takes no such input
        except Unpipelinable as e:
            raise Unpipelinable(f"cannot capture {type(module).__name__}: {e}") from None
        except Exception as e:  # fx raises many types; all mean "not symbolically traceable"
            where = f" in {tracer.failed_at!r}" if tracer.failed_at else ""
            raise CaptureError(f"torch.fx could not trace {type(module).__name__}{where}: {first_line(e)}") from None
        return fx.GraphModule(module, graph, class_name=type(module).__name__)

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
            where = f" in {e.module_path!r}" if e.module_path else ""
            raise CaptureError(
                f"cannot capture {type(module).__name__}: {fx_error}; torch.export failed{where}: "
                f"{first_line(e.cause)}. Way out: in that module, replace Python branches on tensor values with "
                "torch.where / torch.cond, or move the data-dependent step into the batch or loss function") from None
        self.in_spec, self.out_spec, self.fixed_batch = exported.in_spec, exported.out_spec, exported.fixed_batch
        self.forward_sets = exported.forward_sets
        return _without_metadata_asserts(exported.gm)

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
    def _group_units(self, root: nn.Module) -> List[Unit]:
        compute = [n for n in self.gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
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

    # --- edits (runtime.casts: a graph taking the run's precision) ---------------------------
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
        nodes = [n for u in self.units[first:end] for n in u.nodes]
        if end == len(self.units):
            nodes.append(next(n for n in self.gm.graph.nodes if n.op == "output"))
        used_inputs = {s.name for n in nodes for s in n.all_input_nodes if s.op == "placeholder"}
        # what the stage computes again instead of receiving reads model inputs too
        inside = {n.name for n in nodes}
        again = {s for n in nodes for s in n.all_input_nodes if s.name in self.recomputed and s.name not in inside}
        used_inputs |= needed_inputs(self.gm, self.recomputed, again)
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
                if node.name in self.recomputed:  # computed again here from inputs and buffers
                    for source in node.all_input_nodes:
                        lookup(source)
                    env[node] = graph.node_copy(node, lookup)
                elif node.op != "get_attr":
                    raise CaptureError(f"stage [{first}, {end}) needs {node.name!r}, which does not reach it")
                else:
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
            graph.output(fx.map_arg(output.args[0], lookup), type_expr=output.type)
        else:
            graph.output(tuple(env[by_name[name]] for name in io.sent))
        if io.is_last and self.out_spec is not None:
            # The loss sees the model's real output type (tuple, dict, ModelOutput dataclass ...).
            names = io.inputs + io.received
            graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(
                orig_args=names, in_spec=pytree.tree_structure((tuple(names), {})), out_spec=self.out_spec)))
        graph.lint()
        stage = fx.GraphModule(self.gm, graph, class_name=f"Stage_{first}_{end}")
        return stage, io

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


def _joined(units: List[Unit], merges: List[Merge]) -> List[Unit]:
    """`units` with each merge's range joined into one unit, named after its first."""
    joined, k = [], 0
    for merge in merges:
        joined += units[k:merge.first]
        joined.append(Unit(merge.kept, [n for u in units[merge.first:merge.last + 1] for n in u.nodes]))
        k = merge.last + 1
    return joined + units[k:]


# The batch function of the ModelSpec that built each module (export needs an example batch).
_EXAMPLE_BATCHES: "weakref.WeakKeyDictionary[nn.Module, Callable]" = weakref.WeakKeyDictionary()
EXAMPLE_BATCH_SIZE = 2  # dynamic batch dimensions must not be 0 or 1 when exported


def remember_batch(module: nn.Module, batch: Callable) -> None:
    """Record `batch(batch_size, step)` for `module`, so capture can export it on an example."""
    _EXAMPLE_BATCHES[module] = batch


def example_batch(module: nn.Module) -> Any:
    batch = _EXAMPLE_BATCHES.get(module)
    return batch(EXAMPLE_BATCH_SIZE, 0)[0] if batch is not None else None


def _without_metadata_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    """torch.export checks each traced tensor's dtype and device as it was traced
    (`aten._assert_tensor_metadata`); a run under autocast (bf16-mixed) or on another device
    legitimately differs, so the checks go (they compute nothing)."""
    check = torch.ops.aten._assert_tensor_metadata.default
    for graph_module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        for node in [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is check]:
            if not node.users:
                graph_module.graph.erase_node(node)
        graph_module.recompile()
    return gm


def capture(module: nn.Module, example_inputs: Any = None, method: str = "auto") -> CapturedModel:
    """fx if it can, torch.export otherwise (see CapturedModel)."""
    return CapturedModel(module, example_inputs, method)


def run_all_nodes(captured: CapturedModel, inputs: Any, grad: bool = False) -> Dict[str, Any]:
    """Run the captured model once on a batch's `inputs`, returning every node's value by name
    (a node that raises: planner.model.failures.NodeRunError, naming it).

    With `grad=True` autograd records the run, so each value's `requires_grad` is meaningful."""
    values: Dict[str, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            try:
                result = super().run_node(n)
            except Exception as e:  # the model's own error, whatever its type: say where it came from
                raise NodeRunError(n, e) from e
            values[n.name] = result
            return result

    with torch.set_grad_enabled(grad):
        _Recorder(captured.gm).run(*captured.input_values(inputs))
    return values
