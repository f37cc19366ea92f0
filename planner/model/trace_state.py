"""Python state a captured graph would fix at the value it had while tracing.

torch.fx and torch.export run forward's Python once. What that Python computes from state outside
the tensors becomes a constant of the graph, and every step then trains with it while one process
recomputes it each call:

- a plain attribute forward changes (`self.calls += 1; scale = min(1, self.calls / 4)`): the traced
  value forever (and the model left changed by the trace);
- a random draw in Python (`random.random() < self.layerdrop`, numpy's generator): one fixed choice
  of the layers that run, the others never trained;
- under torch.fx, a draw from torch's generator that no traced value feeds (`float(torch.rand(()))`):
  the same. torch.export records torch's random operations in the graph instead, so only fx refuses.

`PythonState` snapshots the model's plain attributes and Python's generators before capture and
says, after it, what changed (putting them back, as after a capture that failed); `torch_draws`
watches one fx trace.

An attribute forward sets afresh each call (Funnel's `pooling_mult = 1` at the start of forward) is
not state carried between steps. It is told from a counter by tracing again from the values the
first trace left: forward must leave them as they are (a fixed point) and trace the same graph.
Then one process, from its first step's state or any later one, runs that graph every step. A
second identical trace alone would not do: `calls += 1` with `if calls > 3` traces the same graph
twice and another one later (not a fixed point), and an `initialized` flag is a fixed point whose
first trace differs from every later forward (not the same graph).
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import fx, nn

from planner.errors import CaptureError

PLAIN = (bool, int, float, str, type(None))  # values a graph would keep as constants


class PythonState:
    """The model's plain attributes and Python's (and numpy's) random state, before a capture."""

    def __init__(self, root: nn.Module):
        self.root = root
        self.values: List[Tuple[nn.Module, str, str, Any]] = [
            (module, path, name, value) for path, module in root.named_modules()
            for name, value in vars(module).items() if not name.startswith("_") and isinstance(value, PLAIN)]
        self.random = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def changed(self, trace_again: Optional[Callable[[], fx.GraphModule]] = None,
                traced: Optional[fx.GraphModule] = None) -> Optional[str]:
        """Why the capture is refused (one line), or None; the state is put back either way.

        With `trace_again` (a capture of the model as it stands) and the first trace's graph
        `traced`, attributes the trace changed are accepted when a trace from their new values
        changes nothing and gives the same graph."""
        try:
            drawn = self._drawn()
            reason = drawn or self._moved()
            if reason and not drawn and trace_again is not None and traced is not None:
                reason = None if _settled(self.root, trace_again, traced) else reason
        finally:
            self.put_back()
        return reason

    def _moved(self) -> Optional[str]:
        for module, path, name, value in self.values:
            now = vars(module).get(name, value)
            if now is not value and now != value:
                where = f"{path}.{name}" if path else name
                return (f"forward changes the attribute {where!r} ({value!r} before the trace, {now!r} after, and "
                        "again when traced from there, or into another graph), whose traced value the captured graph "
                        "would keep for every step; keep it in a buffer (a tensor) if the computation reads it")
        return None

    def _drawn(self) -> Optional[str]:
        numpy = sys.modules.get("numpy")
        if random.getstate() != self.random or (
                self.numpy is not None and numpy is not None and
                not _same_numpy_state(numpy.random.get_state(), self.numpy)):
            return ("forward draws random numbers in Python (random, numpy.random), so the captured graph would fix "
                    "one draw (a LayerDrop's choice of layers) for every step; draw with torch on tensors "
                    "(torch.rand(..., device=x.device)) and select with torch.where, or turn the randomness off")
        return None

    def put_back(self) -> None:
        """The model's plain attributes and the generators as they were (also after a failed capture)."""
        for module, _, name, value in self.values:
            vars(module)[name] = value
        random.setstate(self.random)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and numpy is not None:
            numpy.random.set_state(self.numpy)


def _settled(root: nn.Module, trace_again: Callable[[], fx.GraphModule], traced: fx.GraphModule) -> bool:
    """Traced again from the attributes' values after the first trace: unchanged, the same graph."""
    left = PythonState(root)
    try:
        again = trace_again()
    except Exception:  # the second trace failing is a reason too: the first one's stands
        return False
    return left._moved() is None and left._drawn() is None and same_graph(traced, again)


def same_graph(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """The same code, reading equal constants (tensors the trace made, nested graphs)."""
    if a.code != b.code:
        return False
    for node in a.graph.nodes:
        if node.op == "get_attr":
            x, y = _attribute(a, node.target), _attribute(b, node.target)
            if isinstance(x, fx.GraphModule) and isinstance(y, fx.GraphModule):
                if not same_graph(x, y):
                    return False
            elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                if x is not y and (x.shape != y.shape or x.dtype != y.dtype or x.device != y.device or (
                        x.device.type != "meta" and not torch.equal(x, y))):  # meta: no values to differ
                    return False
            elif x is not y and type(x) is not type(y):
                return False
    return True


def _attribute(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _same_numpy_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and (a[1] == b[1]).all() and tuple(a[2:]) == tuple(b[2:])


@contextlib.contextmanager
def torch_draws() -> Iterator[None]:
    """Around an fx trace: a draw from torch's generator during it is a constant of the graph."""
    before = torch.get_rng_state()
    yield
    if not torch.equal(torch.get_rng_state(), before):
        torch.set_rng_state(before)
        raise CaptureError("forward draws from torch's random generator where no traced value feeds the draw "
                           "(float(torch.rand(())), a LayerDrop's choice), which torch.fx would fix at one value")
