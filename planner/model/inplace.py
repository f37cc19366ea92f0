"""In-place operations in a captured graph: which nodes write into a tensor, which storage they
write to, and which units must therefore stay one unit.

Rule (capture applies it to the units it groups): **a unit boundary never falls between a
tensor's producer and an operation that writes into that tensor (or into a view of it)**; the
units from the producer's to the writer's are merged into one, named after the first. So
`nn.ReLU(inplace=True)` after a BatchNorm that is a unit of its own joins the BatchNorm's unit,
and `skip.add_(x)` several units after `skip` was made merges the units in between. What runs
is then exactly the model's own code: the write happens where eager PyTorch does it, on the
tensor eager PyTorch writes, and the profile's saved and cut bytes are those of the in-place
form. A stage never writes into a tensor it received (a leaf that requires grad, on which
autograd refuses in-place writes, and a copy: the write would not reach the other aliases).

Tensors the graph did not produce:
- a model input (every rank rebuilds the batch itself, so a write reaches only its own copy):
  from its first write on, the graph makes its values, so later writes join the first write's
  unit, and so does every later unit that reads, after that write, the input itself or a view of
  it made before the write (values made from it at or after the write cross cuts as usual);
- a parameter or buffer (each stage holds its own): every unit reading the written tensor, under
  any of its names, is merged into one (BatchNorm's running statistics are read and written inside
  its own unit; two BatchNorms given one `running_mean` are one unit).

Writers: modules with `inplace=True` (`nn.ReLU`, `nn.Hardswish`, `nn.SiLU`, `nn.Dropout`, ...),
functions called with `inplace=True`, `torch.*_` functions (`torch.relu_`), tensor methods
ending in `_` (`add_`, `mul_`, `clamp_`, `masked_fill_`, ...), augmented assignments (`+=`,
recorded by capture's tracer as `augmented_assign` so that the graph keeps the in-place add eager
PyTorch runs), `x[i] = v`, `out=` arguments, and ATen operators whose schema marks an argument
as written (the torch.export path). Aliases are followed through view operations (slicing,
`view`, `reshape`, `transpose`, `chunk`, ..., and ATen operators whose schema says the result
aliases an argument), conservatively: an operation that may return its input counts as a view.
"""
from __future__ import annotations

import builtins
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

# operator's in-place functions, by the statement they stand for
_AUGMENTED = {"iadd": "+=", "isub": "-=", "imul": "*=", "itruediv": "/=", "ifloordiv": "//=", "imod": "%=",
              "ipow": "**=", "iand": "&=", "ior": "|=", "ixor": "^=", "ilshift": "<<=", "irshift": ">>=",
              "imatmul": "@="}


def augmented_assign(op: str, target: Any, value: Any) -> Any:
    """`target op= value` (op: "iadd", "imul", ...): in place for tensors, as eager PyTorch runs
    `out += identity`. A graph node of its own (not operator.iadd, which fx's code generator
    prints as a statement that rebinds the variable, wrong for ints)."""
    return getattr(operator, op)(target, value)


class AugmentedProxy(fx.Proxy):
    """An fx proxy that records `a += b` as a write into `a` (fx's own Proxy has no `__iadd__`,
    so Python falls back to `a = a + b`: out of place, and wrong if `a` aliases another tensor)."""


def _define_augmented(op: str) -> None:
    def method(self: fx.Proxy, value: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", augmented_assign, (op, self, value), {})

    method.__name__ = f"__{op}__"
    setattr(AugmentedProxy, method.__name__, method)


for _op in _AUGMENTED:
    _define_augmented(_op)

# Tensor methods ending in "_" that do not write a tensor's values.
_NOT_WRITES = {"requires_grad_", "share_memory_"}
# Python-level operations whose result may share storage with their first tensor argument.
_VIEW_NAMES = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "narrow", "select", "expand",
    "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "chunk", "split", "split_with_sizes",
    "tensor_split", "unbind", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "as_strided", "detach",
    "contiguous", "unfold", "view_as_real", "view_as_complex", "real", "imag", "to", "type", "type_as", "float",
    "double", "half", "bfloat16", "int", "long", "bool", "cpu", "cuda", "__getitem__", "getitem", "align_as",
    "as_subclass", "data", "T", "mT", "H", "mH", "adjoint", "hsplit", "vsplit", "dsplit",
}
_VIEW_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                 nn.AlphaDropout)


@dataclass
class Merge:
    """Units `first`..`last` joined into one, named `kept` (the first's name), because of `writes`
    ("nn.ReLU(inplace=True) in unit 'relu' writes into a tensor made in unit 'bn1'", ...)."""

    first: int
    last: int
    kept: str
    absorbed: List[str]
    writes: List[str]


@dataclass
class Write:
    """A node that writes into the value of `written` (a node)."""

    node: fx.Node
    written: fx.Node

    def describe(self, root: nn.Module) -> str:
        """The operation, as a user would recognise it: "nn.ReLU(inplace=True)", "'add_'", "'+='"."""
        node = self.node
        if node.op == "call_module":
            return f"nn.{type(root.get_submodule(node.target)).__name__}(inplace=True)"
        if node.target is augmented_assign:
            return f"'{_AUGMENTED.get(node.args[0], node.args[0])}'"
        return f"{operation_name(node)!r}"


def operation_name(node: fx.Node) -> str:
    """A short name of what a node calls: 'add_', 'relu_', 'aten.relu_', 'conv1'."""
    target = node.target
    if node.op in ("call_method", "call_module"):
        return str(target)
    if isinstance(target, torch._ops.OpOverload):  # aten.relu_, planner.autograd_function
        return target._schema.name.replace("::", ".")
    return getattr(target, "__name__", str(target))


def _bound_arguments(target: Any, node: fx.Node) -> Optional[Dict[str, Any]]:
    try:
        return dict(inspect.signature(target).bind(*node.args, **node.kwargs).arguments)
    except (TypeError, ValueError):
        return None


def _from_torch(target: Any) -> bool:
    return (getattr(target, "__module__", None) or "").split(".")[0] == "torch"


def _node_arg(value: Any) -> Optional[fx.Node]:
    return value if isinstance(value, fx.Node) else None


# torch.export's higher-order operations around a region run in another grad or autocast mode: where
# their body (a graph module) sits among the arguments, its operands after it
_REGIONS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}


def written_nodes(node: fx.Node, root: nn.Module) -> List[fx.Node]:
    """The graph values `node` writes into (empty for an operation that writes nothing)."""
    first = _node_arg(node.args[0]) if node.args else None
    written: List[Optional[fx.Node]] = []
    if node.op == "call_module":
        if getattr(root.get_submodule(node.target), "inplace", False) is True:
            written.append(first)
    elif node.op == "call_method":
        name = str(node.target)
        if (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES) or \
                name == "__setitem__" or name.strip("_") in _AUGMENTED:
            written.append(first)
    elif node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            for position, argument in enumerate(schema.arguments):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
                    written.append(_node_arg(value))
        elif getattr(target, "__name__", "") in _REGIONS:  # torch.export's no_grad / autocast regions
            body = _REGIONS[target.__name__]  # its body, a graph module, then its operands: what it writes of them
            operands = node.args[body + 1:]
            written.extend(_node_arg(operands[i]) for i in
                           written_inputs(root.get_submodule(str(node.args[body].target))) if i < len(operands))
        elif target is augmented_assign:
            written.append(_node_arg(node.args[1]))
        elif target is operator.setitem or (getattr(target, "__name__", "") in _AUGMENTED and
                                            getattr(target, "__module__", "") in ("_operator", "operator")):
            written.append(first)
        else:
            name = getattr(target, "__name__", "")
            if name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES and \
                    _from_torch(target):  # torch.relu_ (operator.and_ is not a write)
                written.append(first)
            elif "inplace" in node.kwargs or len(node.args) > 1:  # F.relu(x, inplace=True), F.relu(x, True)
                bound = _bound_arguments(target, node)
                if bound is not None and bound.get("inplace") is True:
                    written.append(first)
        if "out" in node.kwargs:
            written.extend(_node_arg(v) for v in (node.kwargs["out"] if isinstance(node.kwargs["out"], (tuple, list))
                                                  else [node.kwargs["out"]]))
    return [w for w in written if w is not None]


def alias_source(node: fx.Node, root: nn.Module) -> Optional[fx.Node]:
    """The input whose storage `node`'s result may share (views, in-place results), else None."""
    first = _node_arg(node.args[0]) if node.args else None
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        if isinstance(module, _VIEW_MODULES) or getattr(module, "inplace", False) is True:
            return first
        return None
    if node.op == "call_method":
        name = str(node.target)
        return first if name in _VIEW_NAMES or written_nodes(node, root) else None
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if not any(r.alias_info is not None for r in schema.returns):
            return None
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is not None:
                value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
                return _node_arg(value)
        return None
    if target is augmented_assign:
        return _node_arg(node.args[1])
    if target is builtins.getattr or target is operator.getitem:
        return first
    if getattr(target, "__name__", "") in _VIEW_NAMES and _from_torch(target):
        return first
    return first if written_nodes(node, root) else None


def storage_roots(graph: fx.Graph, root: nn.Module) -> Dict[fx.Node, fx.Node]:
    """Each node's storage root: following alias sources back to a node that made fresh storage
    (a computation, a model input, a parameter or buffer)."""
    roots: Dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        source = alias_source(node, root) if node.op.startswith("call_") else None
        roots[node] = roots.get(source, source) if source is not None else node
    return roots


def writes(graph: fx.Graph, root: nn.Module) -> List[Write]:
    return [Write(node, w) for node in graph.nodes if node.op.startswith("call_") for w in written_nodes(node, root)]


def _unit_at(reader: fx.Node, unit_of: Dict[fx.Node, int], last_unit: int) -> Optional[int]:
    """The unit a reader runs in (the graph's output: the last one's), None for none."""
    return last_unit if reader.op == "output" else unit_of.get(reader)


class _Holders:
    """Who reads each parameter and buffer across units: the units calling a module (a call reads its
    state where the graph does not show), and the units reading it as an attribute (or a view of it).
    A tensor is known by its identity, not its name: `c.weight = a.weight` or two BatchNorms given one
    `running_mean` tie modules to one tensor, of which each stage would hold its own copy."""

    def __init__(self, graph: fx.Graph, root: nn.Module, unit_of: Dict[fx.Node, int], last_unit: int,
                 roots: Dict[fx.Node, fx.Node]):
        self.root = root
        self.calls: Dict[str, List[int]] = {}  # module path -> the units calling it
        for node in graph.nodes:
            if node.op == "call_module" and node in unit_of:
                self.calls.setdefault(str(node.target), []).append(unit_of[node])
        self._state = {path: {id(t) for t in [*root.get_submodule(path).parameters(),
                                               *root.get_submodule(path).buffers()]} for path in self.calls}
        self._readers: Dict[Any, List[int]] = {}  # a tensor's key -> units reading it as an attribute
        for node in graph.nodes:
            base = roots.get(node, node)
            for user in node.users if base.op == "get_attr" else ():
                spot = _unit_at(user, unit_of, last_unit)
                if spot is not None:
                    self._readers.setdefault(self._key(str(base.target)), []).append(spot)

    def _key(self, name: str) -> Any:
        """The tensor's identity where `name` is a tensor of the root, else the name itself."""
        try:
            value = self.root.get_submodule(name.rpartition(".")[0]) if "." in name else self.root
            value = getattr(value, name.rpartition(".")[2])
        except (AttributeError, TypeError):
            return name
        return id(value) if isinstance(value, torch.Tensor) else name

    def units_reading(self, name: str) -> List[int]:
        """Every unit reading the state `name`: through an attribute, or by calling a module holding it."""
        key = self._key(name)
        called = [unit for path, units in self.calls.items()
                  if name.startswith(path + ".") or key in self._state[path] for unit in units]
        return self._readers.get(key, []) + called


def units_to_merge(graph: fx.Graph, root: nn.Module, unit_of: Dict[fx.Node, int], last_unit: int,
                   roots: Dict[fx.Node, fx.Node], holders: _Holders) -> List[Tuple[int, int, Write]]:
    """[(first unit, last unit, the write that ties them)] for every write that reaches across
    units, by the module docstring's rule (ranges may overlap; the caller joins them); `roots`:
    storage_roots."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    members: Dict[fx.Node, List[fx.Node]] = {}
    for node, r in roots.items():
        members.setdefault(r, []).append(node)
    all_writes = writes(graph, root)
    first_write: Dict[fx.Node, Write] = {}
    for write in all_writes:
        first_write.setdefault(roots.get(write.written, write.written), write)
    ranges = []

    def tie(lo: int, hi: int, write: Write) -> None:
        if lo != hi:
            ranges.append((lo, hi, write))

    for write in all_writes:
        base = roots.get(write.written, write.written)
        where = unit_of.get(write.node)
        if where is None:
            continue
        if base in unit_of:  # made by the graph: producer and writer in one unit
            tie(min(unit_of[base], where), where, write)
            continue
        readers = [(member, reader) for member in members.get(base, [base]) for reader in member.users]
        at = lambda reader: _unit_at(reader, unit_of, last_unit)  # noqa: E731
        if base.op == "get_attr":  # state each stage holds across steps: every reader with the writer
            spots = [at(reader) for _, reader in readers if at(reader) is not None]
            spots += holders.units_reading(str(base.target))  # under any of its names, and modules holding it
            tie(min(spots + [where]), max(spots + [where]), write)
            continue
        # A model input (each rank has its own copy): from the group's first write on, the graph
        # makes its values. Later writes join the first one; a read after the first write of the
        # input itself, or of a view made before it, joins the first write too.
        first = first_write[base]
        start = unit_of.get(first.node, where)
        if write is not first:
            tie(start, where, write)
            continue
        for member, reader in readers:
            spot = at(reader)
            if spot is None or order[reader] <= order[first.node]:
                continue
            if member not in unit_of or order[member] < order[first.node]:
                tie(min(start, unit_of.get(member, start)), max(start, spot), write)
    return ranges


def state_written_by(module: nn.Module) -> List[str]:
    """Names (relative to `module`) of the state a module's call writes in place: a normalisation's
    running statistics, an embedding's rows renormalised to `max_norm`, the vectors of the older
    `torch.nn.utils.spectral_norm`'s power iteration (its forward pre-hook) and of the parametrization
    (a submodule of the module it parametrizes, whose call reaches it)."""
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    if getattr(module, "track_running_stats", False) and getattr(module, "running_mean", None) is not None:
        return [name for name, _ in module.named_buffers(recurse=False)]
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
        return ["weight"]
    if isinstance(module, _SpectralNorm):
        return ["_u", "_v"]
    norms = [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, SpectralNorm)]
    return [f"{hook.name}_{v}" for hook in norms for v in ("u", "v")]


def _state_ranges(root: nn.Module, holders: _Holders) -> List[Tuple[int, int, str]]:
    """[(first unit, last unit, why)]: a module writing its own state (`state_written_by`) and every
    unit reading that state (calling a module that holds it, or reading it as an attribute) are one:
    each stage holds its own copy (a BatchNorm called at two places, an embedding's weight tied to
    an output layer)."""
    ranges = []
    for path in holders.calls:
        written = [f"{path}.{name}" for name in state_written_by(root.get_submodule(path))]
        spots = [unit for name in written for unit in holders.units_reading(name)]
        if spots and min(spots) != max(spots):
            ranges.append((min(spots), max(spots), f"module {path!r} ({type(root.get_submodule(path)).__name__}) writes "
                                                    f"its state {written[0].rsplit('.', 1)[-1]!r} in place and units "
                                                    f"{min(spots)}-{max(spots)} read it"))
    return ranges


def join_ranges(ranges: Sequence[Tuple[int, int, Any]]) -> List[Tuple[int, int, List[Any]]]:
    """Overlapping unit ranges joined: [(first, last, [what tied them])], sorted."""
    joined: List[Tuple[int, int, List[Any]]] = []
    for lo, hi, why in sorted(ranges, key=lambda r: (r[0], r[1])):
        if joined and lo <= joined[-1][1]:
            first, last, whys = joined[-1]
            joined[-1] = (first, max(last, hi), whys + [why])
        else:
            joined.append((lo, hi, [why]))
    return joined


def writes_across_units(gm: fx.GraphModule, units: Sequence[Sequence[fx.Node]], names: Sequence[str]) -> List[Merge]:
    """The unit ranges to join, by the module docstring's rule, with why (units: each unit's nodes,
    in order; `gm` holds their graph)."""
    unit_of = {node: k for k, nodes in enumerate(units) for node in nodes}
    roots = storage_roots(gm.graph, gm)
    holders = _Holders(gm.graph, gm, unit_of, len(units) - 1, roots)
    joined = join_ranges(units_to_merge(gm.graph, gm, unit_of, len(units) - 1, roots, holders) +
                         _state_ranges(gm, holders))
    return [Merge(lo, hi, names[lo], list(names[lo + 1:hi + 1]),
                  [_why(gm, w, names, unit_of, roots) if isinstance(w, Write) else w for w in tying])
            for lo, hi, tying in joined]


def _why(gm: fx.GraphModule, write: Write, names: Sequence[str], unit_of: Dict[fx.Node, int],
         roots: Dict[fx.Node, fx.Node]) -> str:
    written = write.written
    root = roots.get(written, written)
    if root.op == "get_attr":  # a parameter or buffer, through a view (`.data`, a slice)
        written = root
    if written in unit_of:
        what = f"a tensor made in unit {names[unit_of[written]]!r}"
    elif written.op == "placeholder":
        what = f"model input {written.name!r}"
    else:
        kind = "buffer" if str(written.target) in dict(gm.named_buffers()) else "parameter"
        what = f"{kind} {written.target!r}"
    return f"{write.describe(gm)} in unit {names[unit_of[write.node]]!r} writes into {what}"


def written_inputs(gm: fx.GraphModule) -> List[int]:
    """Positions of a graph module's inputs that its operations write into (directly or through a
    view): a stage writing into a model input changes it for the next call (profiling calls a
    unit many times on the same inputs)."""
    roots = storage_roots(gm.graph, gm)
    written = {roots.get(w.written, w.written) for w in writes(gm.graph, gm)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, node in enumerate(placeholders) if node in written]
