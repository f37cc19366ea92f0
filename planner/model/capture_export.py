"""The torch.export path of capture: for models torch.fx cannot trace symbolically.

`torch.export.export(strict=False)` runs the model's Python on fake tensors, so shape-dependent
control flow and library code (Hugging Face models) go through. Its graph is an FX graph too:
after unlifting (`ExportedProgram.module()`), parameters and buffers are `get_attr` nodes under
the model's original qualified names, and each node's `nn_module_stack` says which module calls
produced it. We normalise that into the same `node.meta["module_stack"]` the fx tracer writes,
so unit grouping, crossings and stage cutting are shared by both paths.

The batch dimension (dim 0 of every tensor input) is exported as dynamic so one graph serves
every micro-batch size; sizes derived from it become integer nodes that cross cuts as constants.
Where the model's code needs a fixed batch size (LLaVA turns its image features into a Python
list, one entry per image), export specialises the graph to the example's: `fixed_batch` says so,
and profiling or running another micro-batch size is refused in one line.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import logging
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from planner.errors import CaptureError
from planner.model.trace_state import PLAIN
from planner.model.whole_function import whole_apply

# Nodes that only check what export assumed about the example inputs (device, dtype, guards):
# a stage cut out of the graph runs on other sizes and devices, so they are dropped.
_CHECK_TARGETS = tuple(t for t in (
    getattr(torch.ops.aten, "_assert_tensor_metadata", None),
    getattr(torch.ops.aten, "_assert_scalar", None),
    getattr(torch.ops.aten, "sym_constrain_range_for_size", None),
) if t is not None)


@dataclass
class ExportedGraph:
    """An unlifted export graph and how to map a batch's inputs and outputs onto it."""

    gm: fx.GraphModule
    in_spec: Any  # pytree spec of (args, kwargs)
    out_spec: Any  # pytree spec of the model's output (tuple, dict, dataclass ...)
    fixed_batch: Optional[int] = None  # the batch size export fixed, when the model's code needs one
    forward_sets: List[str] = field(default_factory=list)  # plain attributes forward assigns a tensor to (dotted)


class ExportFailure(RuntimeError):
    """torch.export failed; `module_path` is the innermost submodule running when it did."""

    def __init__(self, cause: BaseException, module_path: str):
        super().__init__(str(cause))
        self.cause = cause
        self.module_path = module_path

    def way_out(self) -> str:
        """What to change in that module: a tensor made on the host while the model is on the meta
        device (an analytic profile, a model built without memory) needs the input's device; a tensor
        read as a size (a FakeTensor where ints are wanted) needs ints; otherwise it is a Python branch
        on values, as most export failures are."""
        message = str(self.cause)
        if "meta" in message and "device" in message:
            return ("it makes a tensor on the host (torch.tensor(...), torch.ones(n) without device=) while the model "
                    "is on the meta device (an analytic profile): make it on the input's device (device=x.device)")
        if "FakeTensor" in message and ("size" in message or "int" in message):
            return ("it uses a tensor's values as a size or a count (pack_padded_sequence's lengths, torch.zeros(n) "
                    "with n a tensor), which a captured graph cannot keep: pad to a fixed length and mask instead, or "
                    "make the size a constant")
        return ("replace Python branches on tensor values with torch.where / torch.cond, or move the data-dependent "
                "step into the batch or loss function")


class _TorchRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "torch" or record.name.startswith("torch."))


@contextlib.contextmanager
def torch_quiet() -> Iterator[None]:
    """Hold back what torch itself says while a model is captured: its loggers' records (symbolic
    shape warnings), the partial graph torch.export prints on stderr when it fails, and Python
    warnings. A failure is reported as one CaptureError line instead; with PLANNER_TRACEBACK=1 (a
    bug report) everything goes through. Other libraries' log records are left alone."""
    if os.environ.get("PLANNER_TRACEBACK"):
        yield
        return
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    handlers = {handler for logger in loggers for handler in logger.handlers}
    drop = _TorchRecords()
    for handler in handlers:  # torch's own handler keeps the stderr it was made with: filter it
        handler.addFilter(drop)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(drop)


def split_inputs(inputs: Any) -> Tuple[tuple, Dict[str, Any]]:
    """A batch's `inputs` as (args, kwargs): a trailing dict holds the keyword arguments."""
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if inputs and isinstance(inputs[-1], dict):
        return inputs[:-1], dict(inputs[-1])
    return inputs, {}


def _dynamic_batch(module: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """dim 0 of every tensor input is the (dynamic) batch dimension."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)

    def spec(value: Any) -> Any:
        return pytree.tree_map(lambda v: {0: torch.export.Dim.AUTO} if isinstance(v, torch.Tensor) and v.dim()
                               else None, value)

    return {name: spec(value) for name, value in bound.arguments.items()}


def innermost_module(root: nn.Module, error: BaseException) -> str:
    """The path of the innermost submodule of `root` whose code raised `error` ("" if none)."""
    by_id = {id(m): name for name, m in root.named_modules() if name}
    found = ""
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in by_id:
            found = by_id[id(owner)]
        tb = tb.tb_next
    return found


def export_graph(module: nn.Module, example_inputs: Any) -> ExportedGraph:
    """Export `module` on `example_inputs` (batch of 2 or more) and normalise the graph."""
    args, kwargs = split_inputs(example_inputs)
    try:
        with _watching_export(module) as (forward_sets, plain_sets):
            program = torch.export.export(module, args, kwargs, dynamic_shapes=_dynamic_batch(module, args, kwargs),
                                          strict=False)
        for owner, name, value in plain_sets.values():  # as forward left them (export put them back), for
            if name in vars(owner):  # PythonState to see what the trace changed, as after an fx trace
                vars(owner)[name] = value
    except _Dropped as e:
        raise CaptureError(f"with torch.export, {e}") from None
    except Exception as e:  # export raises many types; all mean "cannot capture"
        raise ExportFailure(e, innermost_module(module, e)) from None
    gm = program.module()
    carried = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in forward_sets]
    if carried:  # the graph holds the attribute's value at capture: the next forward would not see the new one
        raise CaptureError(f"forward reads self.{carried[0]} and sets it again (state kept from one forward to the "
                           f"next), which the graph would keep at its first value; register it as a buffer "
                           f"(register_buffer) so that the graph updates it")
    info = gm.graph._codegen.pytree_info
    _normalise(gm, module)
    gm = _without_metadata_asserts(gm)
    return ExportedGraph(gm=gm, in_spec=info.in_spec, out_spec=info.out_spec, fixed_batch=_fixed_batch(gm),
                         forward_sets=forward_sets)


class _Dropped(BaseException):
    """The model does what an exported graph would silently leave out (a BaseException: model code
    catching Exception does not swallow it)."""


PATCHING = threading.Lock()  # capture patches torch process-wide (the guards, fx's Function calls): one at a time


@contextlib.contextmanager
def _watching_export(root: nn.Module) -> Iterator[List[str]]:
    """Export traces through a custom autograd Function's forward (its backward would be lost): each
    call is kept whole instead (planner.model.whole_function). It traces past a hook registered on a
    tensor (never called) and past a module's full backward hook: each would train another model, so
    it stops the capture. torch's own Functions (a custom operator's registered autograd, torch.cond's,
    checkpoint's) are kept by export and pass.

    Export also puts back a plain attribute forward assigns a tensor to (`self.aux = ...`), which its
    graph does not carry: the list yielded first collects their dotted names
    (planner.model.forward_state). It puts back a number or string forward sets (`self.calls += 1`)
    too; the dict yielded second holds the last such value set on each (module, name)."""
    BackwardHookFunction = getattr(torch.nn.modules._functions, "BackwardHookFunction", None)  # noqa: N806

    apply = torch.autograd.Function.apply.__func__
    hooks = {name: getattr(torch.Tensor, name) for name in ("register_hook", "register_post_accumulate_grad_hook")}

    def guarded_apply(cls, *args, **kwargs):
        if cls is BackwardHookFunction:
            raise _Dropped("a module's full backward hook (register_full_backward_hook) is lost by an exported graph; "
                           "make the model traceable by torch.fx, which calls a hooked module whole")
        if not (getattr(cls, "__module__", "") or "").startswith("torch"):  # kept whole, its backward with it
            try:
                return whole_apply(cls, args, kwargs)
            except CaptureError as e:
                raise _Dropped(str(e)) from None
        return apply(cls, *args, **kwargs)

    def guarded_hook(name: str):
        def refuse(tensor, hook):
            raise _Dropped(f"forward registers a hook on a tensor ({name}), which an exported graph does not keep; "
                           "register it on a module (register_full_backward_hook) instead")
        return refuse

    paths = {id(m): path for path, m in root.named_modules(remove_duplicate=False)}
    forward_sets: List[str] = []
    plain_sets: Dict[Tuple[int, str], Tuple[nn.Module, str, Any]] = {}
    module_setattr = nn.Module.__setattr__

    def recording_setattr(module, name, value):
        if id(module) in paths and not name.startswith("_") and isinstance(value, PLAIN):
            plain_sets[(id(module), name)] = (module, name, value)
        if (id(module) in paths and not name.startswith("_") and not isinstance(value, nn.Module)
                and name not in module._parameters and name not in module._buffers
                and any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))):
            path = f"{paths[id(module)]}.{name}".lstrip(".")
            if path not in forward_sets:
                forward_sets.append(path)
        module_setattr(module, name, value)

    module_to = nn.Module.to

    def to_unless_unchanged(module, *args, **kwargs):
        # a router casting itself to its own dtype in forward (`self.classifier = self.classifier.to(
        # self.dtype)`: Switch Transformers, NLLB-MoE) swaps export's parameters and fails: it changes nothing
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None and all(
                (device is None or tensor.device == device) and
                (dtype is None or not (tensor.is_floating_point() or tensor.is_complex()) or tensor.dtype == dtype)
                for tensor in itertools.chain(module.parameters(), module.buffers())):
            return module
        return module_to(module, *args, **kwargs)

    with PATCHING:
        nn.Module.to = to_unless_unchanged
        torch.autograd.Function.apply = classmethod(guarded_apply)
        for name in hooks:
            setattr(torch.Tensor, name, guarded_hook(name))
        nn.Module.__setattr__ = recording_setattr
        try:
            yield forward_sets, plain_sets
        finally:
            torch.autograd.Function.apply = classmethod(apply)
            for name, original in hooks.items():
                setattr(torch.Tensor, name, original)
            nn.Module.__setattr__ = module_setattr
            nn.Module.to = module_to


def _body_stack(gm: fx.GraphModule, node: fx.Node) -> Dict[str, Any]:
    """The module-call stack of the first operation in a higher-order operation's body (export
    records the region's own node at the model's level, its body's operations where they ran)."""
    for arg in node.args:
        body = getattr(gm, str(arg.target), None) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None
        if isinstance(body, fx.GraphModule):
            for inner in body.graph.nodes:
                if inner.op.startswith("call_") and inner.meta.get("nn_module_stack"):
                    return inner.meta["nn_module_stack"]
    return {}


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


def _fixed_batch(gm: fx.GraphModule) -> Optional[int]:
    """The batch size export specialised the graph to (a Python loop over the samples, say: the
    graph then holds one branch per sample), or None when dim 0 stayed dynamic in every input."""
    # imported here: symbolic_shapes imports sympy (a quarter of a second), which fx-captured models
    # and every rank of a run would otherwise pay
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    for node in gm.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and value.dim() and is_concrete_int(value.shape[0]):
            return int(value.shape[0])
    return None


def _normalise(gm: fx.GraphModule, root: nn.Module) -> None:
    """Drop guard/assert nodes; tag each node with its module-call stack (outermost first)."""
    names = {name for name, _ in root.named_modules() if name}
    for node in list(gm.graph.nodes):
        if (node.op == "call_module" and node.target == "_guards_fn") or \
                (node.op == "call_function" and node.target in _CHECK_TARGETS and not node.users):
            gm.graph.erase_node(node)
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if isinstance(node.target, torch._ops.HigherOrderOperator):  # a region (set_grad_enabled, autocast)
            stack = _body_stack(gm, node) or stack
        node.meta["module_stack"] = [path for path, _ in stack.values() if path in names]
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    # The unlifted module checks inputs against the example in a pre-hook: stages run other sizes.
    gm._forward_pre_hooks.clear()
    gm.graph.lint()
    gm.recompile()
