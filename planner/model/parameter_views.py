"""Units that pass on a view of their own parameter: a Perceiver's or a Q-Former's learned queries
expanded to the batch (`self.latents.unsqueeze(0).expand(b, -1, -1)`) and read by the next unit.

Rule: such a unit does not run with its parameters sharded across data-parallel holders (`--shard
parameters`, ZeRO-3): FSDP2 gathers a unit's parameters before its forward and frees them when it
ends, so the units after it would read freed memory (the rank died of SIGSEGV). The profile marks
such units (`UnitProfile.parameter_view`); `planner solve --shard auto` does not choose parameter
sharding for a profile with one, `planner solve --shard parameters` says the runtime will refuse it,
and the runtime refuses it in one line naming the parameter (runtime.shard_params). A copy in the
model's forward (`.contiguous()` after `expand`) is the fix.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Set

import torch

if TYPE_CHECKING:
    from planner.model.capture import CapturedModel


def units_passing_parameter_views(captured: "CapturedModel", values: Dict[str, Any]) -> Set[int]:
    """The units of `captured` with a value that a later unit (or the graph's output) reads and that is,
    on the run `values` recorded (planner.model.capture.run_all_nodes: node name -> value; meta tensors
    too), a parameter read in that unit alone (a tied one is kept whole where it is shared) or a view of
    one (`contiguous()` of an expanded view copies where the batch is larger than one, not where it is 1)."""
    gm = captured.gm
    unit_of = {node: k for k, unit in enumerate(captured.units) for node in unit.nodes}
    last = len(captured.units) - 1
    parameters = dict(gm.named_parameters())
    readers: Dict[str, Set[int]] = {}  # parameter -> the units reading it
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in parameters:
            readers.setdefault(str(node.target), set()).update(_unit(user, unit_of, last) for user in node.users)
    own = {id(parameters[name]): units.pop() for name, units in readers.items() if len(units) == 1}
    found: Set[int] = set()
    for node, k in unit_of.items():
        value = values.get(node.name)
        if not isinstance(value, torch.Tensor) or not any(_unit(user, unit_of, last) > k for user in node.users):
            continue
        base = value._base if value._is_view() else value
        if own.get(id(base)) == k:
            found.add(k)
    return found


def _unit(node, unit_of, last: int) -> int:
    return last if node.op == "output" else unit_of.get(node, -1)
