"""One line for a model that captures but does not run the way the profiler runs it: which unit,
which operation (and the module it belongs to), what it raised, and what to do.

A unit is run as the stage the runtime would build for it: its inputs from earlier units are
fresh tensors (leaves that require grad, as a receive makes them). An operation that works in
the whole model can fail there; capture keeps in-place writes with the tensors they write into
(planner/model/inplace.py), so what is left are operations capture cannot see into, such as a
`torch.fx.wrap`ped function or a custom autograd function that writes into its input.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import fx, nn

from planner.errors import CaptureError
from planner.model.inplace import operation_name

_FIX = ("fix: write that operation out of place in the model (inplace=False; y = x + z for x += z; x.add(z) for "
        "x.add_(z)), or rerun with PLANNER_TRACEBACK=1 and report the stack")

_LOSS_FIX = ("fix: the loss gets the model's output and the batch's target, computed on the last stage alone; make it "
             "work from those two (PLANNER_TRACEBACK=1 shows the stack)")


class UnitRunError(RuntimeError):
    """Unit `index` raised in `phase` ("forward", "backward") when run as a stage of its own."""

    def __init__(self, index: int, phase: str, cause: BaseException):
        super().__init__(f"unit {index} {phase}: {cause}")
        self.index, self.phase, self.cause = index, phase, cause


class NodeRunError(RuntimeError):
    """A graph node raised while the whole captured model ran (planner.model.capture.run_all_nodes)."""

    def __init__(self, node: fx.Node, cause: BaseException):
        super().__init__(f"{node.name}: {cause}")
        self.node, self.cause = node, cause


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0].rstrip('.') if text else ''}"


def describe_node(node: fx.Node) -> str:
    """"operation 'relu_' in module 'layer1.0.relu'" (the innermost module call it came from)."""
    stack = node.meta.get("module_stack") or []
    where = f" in module {stack[-1]!r}" if stack else " at the model's top level"
    return f"operation {operation_name(node)!r}{where}"


def failing_node(gm: fx.GraphModule, args: Sequence[Any]) -> Optional[fx.Node]:
    """The node of `gm` that raises when it runs on `args` (None if the graph runs through)."""
    current: List[fx.Node] = []

    class _Finder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            current[:] = [n]
            return super().run_node(n)

    try:
        _Finder(gm).run(*args)
    except Exception:  # the failure being located; any type
        return current[0] if current else None
    return None


def unit_failure(unit_name: str, units: int, error: UnitRunError, stage: Any, args: Sequence[Any]) -> CaptureError:
    """The one-line error for a unit that failed as a stage of its own."""
    head = f"unit {unit_name!r} ({error.index + 1} of {units}) cannot run as a pipeline stage"
    node = failing_node(stage, args) if error.phase == "forward" and isinstance(stage, fx.GraphModule) else None
    fix = _FIX
    if node is not None:
        where = describe_node(node)
    elif error.phase == "forward" and error.index == units - 1:
        where, fix = "the loss function", _LOSS_FIX
    elif error.phase == "forward":
        where = "its forward"
    else:
        where = "its backward"
    return CaptureError(f"{head}: {where} raised {first_line(error.cause)}; {fix}")


def model_failure(error: NodeRunError, batch_size: int) -> CaptureError:
    """The one-line error for a captured model that fails on a batch as a whole."""
    return CaptureError(f"the captured model failed on a batch of {batch_size}: {describe_node(error.node)} raised "
                        f"{first_line(error.cause)}; fix the model or its batch function (PLANNER_TRACEBACK=1 shows "
                        "the stack)")


def eager_failure(module: nn.Module, example_inputs: Any) -> Optional[CaptureError]:
    """Where torch.export failed: the model's own code as the cause, when the model simply run on
    `example_inputs` (without gradients) raises too (its error, in one line), else None."""
    from planner.model.spec import call_model

    if any(p.is_meta for p in module.parameters()):  # (an analytic profile: ExportFailure.way_out knows meta's errors)
        return None
    try:
        with torch.no_grad():
            call_model(module, example_inputs)
    except Exception as e:  # noqa: BLE001 (any error of the user's code is the answer)
        return CaptureError(f"{type(module).__name__} raises when run on its example batch, outside any capture: "
                            f"{first_line(e)}; fix the model or its arguments (--model-arg)")
    return None
