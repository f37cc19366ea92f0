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
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn

from planner.errors import CaptureError

_PLAIN = (bool, int, float, str, type(None))


class PythonState:
    """The model's plain attributes and Python's (and numpy's) random state, before a capture."""

    def __init__(self, root: nn.Module):
        self.values: List[Tuple[nn.Module, str, str, Any]] = [
            (module, path, name, value) for path, module in root.named_modules()
            for name, value in vars(module).items() if not name.startswith("_") and isinstance(value, _PLAIN)]
        self.random = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def changed(self) -> Optional[str]:
        """Why the capture is refused (one line), or None; the state is put back either way."""
        reason = None
        for module, path, name, value in self.values:
            now = vars(module).get(name, value)
            if now is not value and now != value:
                where = f"{path}.{name}" if path else name
                reason = (f"forward changes the attribute {where!r} ({value!r} before the trace, {now!r} after), "
                          "whose traced value the captured graph would keep for every step; keep it in a buffer "
                          "(a tensor) if the computation reads it")
                break
        numpy = sys.modules.get("numpy")
        if reason is None and (random.getstate() != self.random or (
                self.numpy is not None and numpy is not None and
                not _same_numpy_state(numpy.random.get_state(), self.numpy))):
            reason = ("forward draws random numbers in Python (random, numpy.random), so the captured graph would fix "
                      "one draw (a LayerDrop's choice of layers) for every step; draw with torch on tensors "
                      "(torch.rand(..., device=x.device)) and select with torch.where, or turn the randomness off")
        self.put_back()
        return reason

    def put_back(self) -> None:
        """The model's plain attributes and the generators as they were (also after a failed capture)."""
        for module, _, name, value in self.values:
            vars(module)[name] = value
        random.setstate(self.random)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and numpy is not None:
            numpy.random.set_state(self.numpy)


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
