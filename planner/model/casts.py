"""Under bf16-mixed, an exported graph computes what the model's code computes under bf16.

torch.export records a cast's dtype as a constant. A model that casts to a tensor's dtype
(GPT-2's attention weights `.type(value.dtype)`, T5's and Llama's norms `.to(input_dtype)`,
LLaVA's image features `.to(embeds.dtype)`) was captured with fp32 weights and no autocast, so every
such cast says float32, and a cast that did nothing there is not in the graph at all. Under
bf16-mixed, in one process, the same lines compute in bfloat16: the captured graph computed another
function (bf16 rounding apart from one process: 4e-5 to 2e-3 after 3 steps).

`recast` exports the model a second time as a bf16-mixed run computes it -- built again without
storage (fake tensors on the run's device: each weight that gets a compute copy in bf16, planner.model.precision), under
`torch.autocast` -- and the run's graph takes, node by node, what differs there (`_Recast`). Its
nodes keep their names and units, and what crosses each cut stays the same (a change that would
alter it is not made), so the plan's units and messages hold. What could not be taken is returned,
for the run to say.

A graph traced by torch.fx needs none of this: it reads a tensor's dtype when it runs.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import fx, nn

from planner.model.capture import CapturedModel, capture
from planner.model.spec import to_device
from planner.model.precision import gets_compute_copy


def recast(captured: CapturedModel, build_on_meta: Callable[[], nn.Module], example_inputs: Any,
           dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> Tuple[int, Optional[str]]:
    """Make `captured` (an export) compute as a run on `device` under `dtype` autocast with
    compute copies does (module docstring): (how many nodes changed, None), or with what was left
    as it was. `build_on_meta` builds the model again with every parameter and buffer on the meta
    device; `example_inputs` is a batch (moved to `device`: autocast's lists are per device)."""
    if captured.method != "export":
        return 0, None
    device = torch.device(device)
    try:
        module = _fake_on(build_on_meta(), dtype, device)
        with torch.autocast(device.type, dtype=dtype):
            mixed = capture(module, example_inputs=to_device(example_inputs, device), method="export")
    except Exception as e:  # whatever stops the second export: the graph stays as captured
        return 0, f"its casts stay as captured in fp32 (the export under bf16 autocast failed: " \
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return _Recast(captured, mixed.gm).run()


def recast_model(captured: CapturedModel, entry: str, model_args: Dict[str, Any], seed: int, example_inputs: Any,
                 dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """`recast` with the model built again on meta from its entry point (planner.model.meta), the
    random state kept (every rank, and the profile, draw alike after it): what it could not take, or None."""
    from planner.model.meta import meta_builder

    with torch.random.fork_rng(devices=[]):
        return recast(captured, meta_builder(entry, model_args, seed), example_inputs, dtype, device)[1]


def _fake_on(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`module` (on meta) with fake tensors on `device` for its parameters and buffers (no storage),
    of `dtype` where a weight gets a compute copy; one object stays one object (a tied weight)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    made: Dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, cast: bool) -> torch.Tensor:
        if id(t) not in made:
            value = torch.empty(t.shape, dtype=dtype if cast else t.dtype, device=device)
            made[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
        return made[id(t)]

    with FakeTensorMode(allow_non_fake_inputs=True):
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None:
                    owner._parameters[name] = fake(param, gets_compute_copy(param))
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[name] = fake(buffer, False)
    return module


_UNMATCHED = object()  # an argument of the mixed graph with no twin among our nodes
_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
          torch.ops.aten._to_copy.default}


class _Recast:
    """The captured graph takes what its twin in the mixed graph does differently, node by node:

    - floating dtypes, and the floats made from them (`torch.finfo(dtype).min` in a mask);
    - the operator, where the model's code picks another kernel for bf16 weights on the same
      arguments (Mixtral's experts: `aten._grouped_mm`, not a custom fallback);
    - the values it reads, where a cast that does nothing in fp32 made the fp32 graph read the
      cast's result (a residual kept as `h` before `h.to(float32)`: one tensor in fp32, two in
      bf16), unless what crosses a cut would change;
    - the casts only bf16 makes (ViT's image `.to(weight.dtype)`), each in the unit of the node
      after it, kept where a node reads it.

    Twins are the nodes the two graphs' operation sequences align, with like arguments."""

    def __init__(self, captured: CapturedModel, mixed: fx.GraphModule):
        self.captured, self.graph = captured, captured.gm.graph
        self.ours, self.theirs = list(self.graph.nodes), list(mixed.graph.nodes)
        self.twin_of: Dict[fx.Node, Any] = {}  # a node of the mixed graph -> ours
        self.before: Dict[fx.Node, Tuple[Any, Any, Any]] = {}  # each changed node as it was
        self.added: List[fx.Node] = []  # the casts only bf16 makes
        self.crossing = captured.crossing_names()
        self.alone = self.kept = 0  # nodes without a twin; reads left as in fp32

    def run(self) -> Tuple[int, Optional[str]]:
        for tag, i1, i2, j1, j2 in _aligned(self.ours, self.theirs):
            near = self._unit_near(i1) if tag == "insert" else None
            if near is not None:
                for twin in self.theirs[j1:j2]:
                    if self._insert(twin, *near):
                        near = (near[0], near[1] + 1)  # the next one after it
            elif tag in ("equal", "replace") and i2 - i1 == j2 - j1:
                for node, twin in zip(self.ours[i1:i2], self.theirs[j1:j2]):
                    self._pair(node, twin)
            else:
                self.alone += max(i2 - i1, j2 - j1)
        for node in reversed(list(self.added)):  # later casts first: one may be an earlier one's only reader
            if not node.users:
                self._erase(node)
        if not self._crossing_kept():  # a safety net: each read was checked as it moved
            self._undo()
            return 0, "it stays as captured in fp32 (under bf16 autocast other values would cross the plan's cuts)"
        if self.before or self.added:
            self.captured.gm.recompile()
        return len(self.before) + len(self.added), self._left()

    def _left(self) -> Optional[str]:
        left = [f"{self.alone} of its operations have none alike under bf16 autocast"] if self.alone else []
        left += [f"{self.kept} of its reads stay as in fp32 (other values would cross the plan's cuts)"] \
            if self.kept else []
        return "; ".join(left) or None

    def _mapped(self, twin: fx.Node) -> Tuple[Any, Any]:
        return fx.node.map_arg((twin.args, twin.kwargs), lambda n: self.twin_of.get(n, _UNMATCHED))

    def _unit_near(self, i: int) -> Optional[Tuple[int, int]]:
        """(unit, position in its node list) for a node put before ours[i]: the unit of ours[i], or
        after the last node before it that has one (before the output, say: the last unit)."""
        unit_of, units = self.captured.unit_of_node, self.captured.units
        if i < len(self.ours) and unit_of(self.ours[i].name) is not None:
            unit = unit_of(self.ours[i].name)
            return unit, units[unit].nodes.index(self.ours[i])
        before = next((n for n in reversed(self.ours[:i]) if unit_of(n.name) is not None), None)
        if before is None:
            return None
        unit = unit_of(before.name)
        return unit, units[unit].nodes.index(before) + 1

    def _insert(self, twin: fx.Node, unit: int, position: int) -> bool:
        """Put a cast only bf16 makes into `unit` at `position`; whether it was one."""
        args, kwargs = self._mapped(twin)
        if twin.op != "call_function" or twin.target not in _CASTS or \
                _UNMATCHED in fx.node.map_aggregate((args, kwargs), lambda a: a):
            self.alone += 1
            return False
        nodes = self.captured.units[unit].nodes
        anchor = nodes[position] if position < len(nodes) else None
        with self.graph.inserting_before(anchor) if anchor is not None else self.graph.inserting_after(nodes[-1]):
            node = self.graph.call_function(twin.target, tuple(args), dict(kwargs))
        node.meta["module_stack"] = twin.meta.get("module_stack", [])
        self.captured.add_to_unit(node, unit, position)
        self.twin_of[twin] = node
        self.added.append(node)
        return True

    def _pair(self, node: fx.Node, twin: fx.Node) -> None:
        self.twin_of[twin] = node
        args, kwargs = self._mapped(twin)
        if node.op != twin.op or (node.target != twin.target and node.op != "call_function") \
                or not _alike((node.args, node.kwargs), (args, kwargs)):
            self.alone += 1
            return
        old = (node.target, node.args, node.kwargs)
        if (twin.target, args, kwargs) == old:
            return
        self.before[node] = old
        reads = node.all_input_nodes
        node.target, node.args, node.kwargs = twin.target, tuple(args), dict(kwargs)
        # a value every stage computes again (captured.recomputed) keeps its reads: the set was made for them
        if node.all_input_nodes != reads and (node.name in self.captured.recomputed or not self._crossing_kept()):
            node.args, node.kwargs = _reads_of((node.args, node.kwargs), (old[1], old[2]))
            self.kept += 1
            if (node.target, node.args, node.kwargs) == old:
                del self.before[node]

    def _crossing_kept(self) -> bool:
        return self.captured.crossing_names() == self.crossing

    def _erase(self, node: fx.Node) -> None:
        self.captured.remove_from_unit(node)
        self.graph.erase_node(node)
        self.added.remove(node)

    def _undo(self) -> None:
        for node, (target, args, kwargs) in self.before.items():
            node.target, node.args, node.kwargs = target, args, kwargs
        for node in list(reversed(self.added)):
            self._erase(node)
        self.before.clear()
        self._crossing_kept()


def _aligned(ours: List[fx.Node], theirs: List[fx.Node]) -> List[Tuple[str, int, int, int, int]]:
    """difflib's opcodes aligning the two graphs' operation sequences, found module call by module
    call: runs of nodes with one module stack are matched first (a layer's path is its own), then
    the operations inside each pair of runs. difflib on a whole graph of like layers is about
    quadratic (10 s at 10,000 nodes); per run it is linear in the layers."""
    def runs(nodes: List[fx.Node]) -> List[Tuple[tuple, int, int]]:
        out: List[Tuple[tuple, int, int]] = []
        for k, node in enumerate(nodes):
            stack = tuple(node.meta.get("module_stack") or ())
            if out and out[-1][0] == stack:
                out[-1] = (stack, out[-1][1], k + 1)
            else:
                out.append((stack, k, k + 1))
        return out

    def opcodes(a: List[Any], b: List[Any]):
        return difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()

    key = lambda n: (n.op, str(n.target))  # noqa: E731
    ours_runs, theirs_runs = runs(ours), runs(theirs)
    out = []
    for tag, r1, r2, q1, q2 in opcodes([r[0] for r in ours_runs], [r[0] for r in theirs_runs]):
        i1, i2 = (ours_runs[r1][1], ours_runs[r2 - 1][2]) if r2 > r1 else (_start(ours_runs, r1, len(ours)),) * 2
        j1, j2 = (theirs_runs[q1][1], theirs_runs[q2 - 1][2]) if q2 > q1 else \
            (_start(theirs_runs, q1, len(theirs)),) * 2
        if tag == "equal":
            for (_, a1, a2), (_, b1, b2) in zip(ours_runs[r1:r2], theirs_runs[q1:q2]):
                out += [(t, a1 + x1, a1 + x2, b1 + y1, b1 + y2) for t, x1, x2, y1, y2 in
                        opcodes([key(n) for n in ours[a1:a2]], [key(n) for n in theirs[b1:b2]])]
        else:  # runs of other module stacks: their operations aligned as one block
            out += [(t, i1 + x1, i1 + x2, j1 + y1, j1 + y2) for t, x1, x2, y1, y2 in
                    opcodes([key(n) for n in ours[i1:i2]], [key(n) for n in theirs[j1:j2]])]
    return out


def _start(runs: List[Tuple[tuple, int, int]], r: int, length: int) -> int:
    """Where run r starts (the end of the sequence past the last run)."""
    return runs[r][1] if r < len(runs) else length


def _alike(ours: Any, theirs: Any) -> bool:
    """The same arguments, but for which node, which floating dtype and which float."""
    if isinstance(ours, (tuple, list)) and isinstance(theirs, (tuple, list)):
        return len(ours) == len(theirs) and all(_alike(a, b) for a, b in zip(ours, theirs))
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(_alike(ours[k], theirs[k]) for k in ours)
    for kind in (fx.Node, float):
        if isinstance(ours, kind):
            return isinstance(theirs, kind)
    if _floating(ours):
        return _floating(theirs)
    return type(ours) is type(theirs) and ours == theirs


def _reads_of(new: Any, old: Any) -> Any:
    """`new` (arguments `_alike` `old`) reading the nodes `old` reads."""
    if isinstance(new, (tuple, list)):
        return type(new)(_reads_of(a, b) for a, b in zip(new, old))
    if isinstance(new, dict):
        return {k: _reads_of(v, old[k]) for k, v in new.items()}
    return old if isinstance(new, fx.Node) else new


def _floating(value: Any) -> bool:
    return isinstance(value, torch.dtype) and value.is_floating_point
