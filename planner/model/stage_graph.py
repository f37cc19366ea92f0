"""A stage cut out of a captured model: units [first, end) of a planner.model.capture.CapturedModel as an
`fx.GraphModule` whose forward takes (model inputs used, values crossing cut `first`) and returns those crossing
cut `end` (the last stage: the model output), and that signature (`StageIO`). Submodules keep their qualified
names, so a stage's `state_dict` keys are the model's; a value computed from inputs and buffers alone
(planner/model/recomputable.py) is computed again in the stage that reads it, from the model inputs it needs.
(`captured`: a CapturedModel, not imported here: capture imports this module.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from torch import fx
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from planner.errors import CaptureError
from planner.model.recomputable import needed_inputs


@dataclass
class StageIO:
    """The signature of a stage module: what it takes and what it returns, by node name."""

    inputs: List[str]  # model input names used by the stage, in the model's order
    received: List[str]  # values crossing the stage's first cut, in graph order
    sent: List[str]  # values crossing its end cut, in graph order (empty for the last stage)
    is_last: bool


def stage_io(captured, first: int, end: int) -> StageIO:
    """What units [first, end) take (the model inputs they and what they compute again read, the values crossing
    cut `first`) and return (those crossing cut `end`)."""
    nodes = [n for u in captured.units[first:end] for n in u.nodes]
    if end == len(captured.units):
        nodes.append(next(n for n in captured.gm.graph.nodes if n.op == "output"))
    used_inputs = {s.name for n in nodes for s in n.all_input_nodes if s.op == "placeholder"}
    # what the stage computes again instead of receiving reads model inputs too
    inside = {n.name for n in nodes}
    again = {s for n in nodes for s in n.all_input_nodes if s.name in captured.recomputed and s.name not in inside}
    used_inputs |= needed_inputs(captured.gm, captured.recomputed, again)
    return StageIO(
        inputs=[p for p in captured.placeholders if p in used_inputs],
        received=[n.name for n in captured.crossing(first)] if first > 0 else [],
        sent=[n.name for n in captured.crossing(end)] if end < len(captured.units) else [],
        is_last=end == len(captured.units),
    )


def stage_module(captured, first: int, end: int) -> Tuple[fx.GraphModule, StageIO]:
    """Units [first, end) as a GraphModule: forward(*inputs, *received) -> tuple(sent) or model output."""
    if not 0 <= first < end <= len(captured.units):
        raise ValueError(f"bad unit range [{first}, {end}) for {len(captured.units)} units")
    io = stage_io(captured, first, end)
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    for name in io.inputs + io.received:
        env[by_name[name]] = graph.placeholder(name)

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.name in captured.recomputed:  # computed again here from inputs and buffers
                for source in node.all_input_nodes:
                    lookup(source)
                env[node] = graph.node_copy(node, lookup)
            elif node.op != "get_attr":
                raise CaptureError(f"stage [{first}, {end}) needs {node.name!r}, which does not reach it")
            else:
                env[node] = graph.node_copy(node)  # parameters and buffers are read where used
        return env[node]

    for unit in captured.units[first:end]:
        for node in unit.nodes:
            for source in node.all_input_nodes:
                lookup(source)
            env[node] = graph.node_copy(node, lookup)
    if io.is_last:
        output = next(n for n in captured.gm.graph.nodes if n.op == "output")
        for source in output.all_input_nodes:
            lookup(source)
        graph.output(fx.map_arg(output.args[0], lookup), type_expr=output.type)
    else:
        graph.output(tuple(env[by_name[name]] for name in io.sent))
    if io.is_last and captured.out_spec is not None:
        # The loss sees the model's real output type (tuple, dict, ModelOutput dataclass ...).
        names = io.inputs + io.received
        graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(
            orig_args=names, in_spec=pytree.tree_structure((tuple(names), {})), out_spec=captured.out_spec)))
    graph.lint()
    stage = fx.GraphModule(captured.gm, graph, class_name=f"Stage_{first}_{end}")
    return stage, io
