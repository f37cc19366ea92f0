"""torch.fx's trace of a model, refusing what a traced graph would compute differently.

The tracer tags every node with the module calls it was made in (`meta["module_stack"]`: the
partition units are grouped from it, planner.model.capture), records `a += b` in place, calls a
hooked or scripted module whole and a custom autograd Function as one node, and refuses (so that
capture tries torch.export, or stops) what fx would silently drop: another autograd or autocast
mode inside forward, hooks, attributes forward assigns, torch draws no traced value feeds
(planner.model.trace_state) and differentiation inside forward (`Unpipelinable`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from planner.errors import CaptureError
from planner.model.capture_export import PATCHING
from planner.model.failures import first_line
from planner.model.inplace import AugmentedProxy
from planner.model.trace_state import torch_draws


class Unpipelinable(CaptureError):
    """What no captured graph can run as pipeline stages (torch.export is not tried)."""


def _modes() -> Tuple[bool, bool, bool, bool]:
    """The autograd and autocast modes an operation runs under (fx records operations, not modes)."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"))


def _hooked(module: nn.Module) -> bool:
    """A module whose call runs hooks: fx, tracing through a module's forward, would drop them."""
    return any(getattr(module, name, None) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


class UnitTracer(fx.Tracer):
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


def refuse_reserved_names(module: nn.Module) -> None:
    """Unpipelinable (no graph would do) where a parameter, buffer or submodule of the root is named like
    an attribute of torch.fx's GraphModule (`code`, `graph`, ...), which holds the root's own tensors
    under their names, captured by fx and torch.export alike (both fail on it, in torch's words)."""
    reserved = set(dir(fx.GraphModule(nn.Module(), fx.Graph()))) - set(dir(nn.Module()))
    for kind, names in (("parameter", module._parameters), ("buffer", module._buffers), ("submodule", module._modules)):
        clash = next((name for name in names if name in reserved), None)
        if clash is not None:
            raise Unpipelinable(f"cannot capture {type(module).__name__}: its {kind} {clash!r} has the name of an "
                                f"attribute of the graph module that holds a captured model (torch.fx and "
                                f"torch.export alike); rename it (e.g. {clash + '_'!r})")


def trace_fx(module: nn.Module, as_none: Set[str]) -> fx.GraphModule:
    """The model's graph as torch.fx traces it, nodes tagged with their module stack, the arguments in
    `as_none` traced as None; CaptureError (one line) where fx cannot record what forward does."""
    tracer = UnitTracer()
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
