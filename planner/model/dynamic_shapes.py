"""Values whose shape depends on the data (a mixture of experts' tokens per expert), and which units
must therefore stay one.

A stage receives each value crossing its cut into a buffer of the shape the plan records (NCCL's
rules: a receive knows its size beforehand), so a value whose shape changes from batch to batch
cannot cross a cut. Rule (capture applies it after the in-place rule): **the units from the one
making such a value to the last one reading it are joined into one**, named after the first
(`CapturedModel.shape_merges` says which and why). A router's tokens per expert (`x[sel]`,
`sel = nonzero(route == e)`) and each expert's output on them stay with the router; the experts'
sum written back (`out.index_add(0, sel, y)`, `out[mask] = y`) has `out`'s shape and crosses as usual.

Which values: those whose shape holds a size torch's symbolic shapes call *unbacked*, one only the
data tells (`nonzero`, boolean-mask indexing, `masked_select`, `unique`, `repeat_interleave` by a
tensor, `bincount`, `.item()` turned into a size), and every value shaped by one. torch.export
records each node's symbolic value (`meta["val"]`). An fx graph runs once under a FakeTensorMode
on the example batch (no storage, no compute; the parameters and the random stream untouched),
only where it holds an operation that can make such a size (`_may_make_data_sizes`); where that
run fails (an operation without a fake kernel), those operations and everything computed from them
count (safe: it joins more units than needed, never fewer). Values each
stage computes again from the model's inputs (planner.model.recomputable) never cross, so they
join nothing.
"""
from __future__ import annotations

import builtins
import operator
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
from torch import fx

from planner.model.inplace import Merge, join_ranges, operation_name

# operations whose result's shape (or, for item/tolist, a number a shape may be made of) the data sets
_DATA_SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique", "_unique2",
               "unique_dim", "repeat_interleave", "bincount", "item", "tolist", "_local_scalar_dense"}
# operations on sizes whose results are sizes again (fx records `x.size(1) // 2` as nodes)
_SIZE_OPS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
             operator.neg, operator.pow, builtins.len, builtins.min, builtins.max, builtins.int}


def _base_name(node: fx.Node) -> str:
    """'nonzero' for torch.nonzero, Tensor.nonzero and aten.nonzero.default alike."""
    if node.op == "call_method":
        return str(node.target)
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]


def _from_torch_nn(module: Any) -> bool:
    return type(module).__module__.startswith("torch.nn")


def _is_size(node: Any, sizes: Set[fx.Node]) -> bool:
    return not isinstance(node, fx.Node) or node in sizes


def _may_make_data_sizes(gm: fx.GraphModule) -> List[fx.Node]:
    """The nodes of an fx graph that may make a size only the data tells: the operations above, a
    one-argument `torch.where`, indexing by a value not known to be a size (a boolean mask is one; an
    integer index tensor is not, but the graph does not say which), and calls the graph does not see
    into (a module called whole that is not torch.nn's, a custom autograd Function)."""
    sizes: Set[fx.Node] = set()  # nodes known to be plain sizes (x.size(1), x.shape[0] // 2)
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in ("size", "dim", "numel"):
            sizes.add(node)
        elif node.op == "call_function" and node.target is builtins.getattr and \
                len(node.args) > 1 and node.args[1] in ("shape", "ndim"):
            sizes.add(node)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in sizes:
            sizes.add(node)
        elif node.op == "call_function" and node.target in _SIZE_OPS and \
                all(_is_size(a, sizes) for a in node.args):
            sizes.add(node)
        elif node.op == "call_module" and not _from_torch_nn(gm.get_submodule(str(node.target))):
            found.append(node)  # a module called whole (hooked, scripted): what it returns is not seen
        elif node.op == "call_function" and hasattr(node.target, "autograd_function"):
            found.append(node)  # a custom autograd Function, one call (capture's _function_apply)
        elif node.op in ("call_function", "call_method"):
            name = _base_name(node)
            index = node.args[1] if len(node.args) > 1 else None
            indexes = index if isinstance(index, (tuple, list)) else (index,)
            if name in _DATA_SIZED or (name == "where" and len(node.args) == 1 and not node.kwargs) or \
                    (name in ("getitem", "__getitem__") and
                     any(isinstance(i, fx.Node) and i not in sizes for i in indexes)):
                found.append(node)
    return found


def _has_data_size(value: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat)) and bool(free_unbacked_symbols(v))
               for v in values)


class _FakeRun(fx.Interpreter):
    """The graph run on fake tensors, naming the nodes whose value holds an unbacked size."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.data_sized: Set[str] = set()

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if _has_data_size(result):
            self.data_sized.add(n.name)
        return result


def _fake_run(gm: fx.GraphModule, inputs: Sequence[Any]) -> Set[str]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.nn.utils.stateless import _reparametrize_module
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    run = _FakeRun(gm)
    # fake copies of the parameters and buffers in their place: a write (BatchNorm's count) reaches them only
    state = {name: mode.from_tensor(t) for name, t in
             [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]}
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _reparametrize_module(gm, state), mode:
        run.run(*[mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in inputs])
    return run.data_sized


def data_sized_nodes(gm: fx.GraphModule, method: str, inputs: Optional[Sequence[Any]]) -> Set[str]:
    """Names of the nodes of `gm` (captured by `method`, "fx" or "export") whose value's shape
    depends on the data (module docstring); `inputs`: the example batch as the graph takes it (an
    fx graph without one: the operations that may make such sizes and everything made from them)."""
    if method == "export":
        return {n.name for n in gm.graph.nodes if _has_data_size(n.meta.get("val"))}
    candidates = _may_make_data_sizes(gm)
    if not candidates:
        return set()
    if inputs is not None:
        try:
            return _fake_run(gm, inputs)
        except Exception:  # an operation with no fake kernel, a guard on data: see the module docstring
            pass
    sized = set(candidates)
    for node in gm.graph.nodes:
        if any(source in sized for source in node.all_input_nodes):
            sized.add(node)
    return {n.name for n in sized}


def data_sizes_across_units(gm: fx.GraphModule, units: Sequence[Sequence[fx.Node]], names: Sequence[str],
                            data_sized: Set[str], recomputed: Set[str]) -> List[Merge]:
    """The unit ranges to join so that no value of `data_sized` crosses a cut (each unit's nodes in
    order; the model's output is read after the last unit), with why."""
    unit_of = {node: k for k, nodes in enumerate(units) for node in nodes}
    last = len(units) - 1
    origin: Dict[fx.Node, fx.Node] = {}  # the operation that made a node's data-told size
    ranges = []
    for node in gm.graph.nodes:
        if node.name not in data_sized:
            continue
        sized_inputs = [source for source in node.all_input_nodes if source in origin]
        origin[node] = origin[sized_inputs[0]] if sized_inputs else node
        if node.name in recomputed or node not in unit_of:
            continue
        made = unit_of[node]
        readers = [last if user.op == "output" else unit_of.get(user, made) for user in node.users]
        read = max(readers, default=made)
        if read > made:
            ranges.append((made, read, f"{node.name!r} has a shape the data sets (through "
                                       f"{operation_name(origin[node])!r}), made in unit {names[made]!r} and read in "
                                       f"unit {names[read]!r}"))
    return [Merge(lo, hi, names[lo], list(names[lo + 1:hi + 1]), list(dict.fromkeys(why)))
            for lo, hi, why in join_ranges(ranges)]
