"""Values a stage computes again from the model's inputs instead of receiving them across a cut.

Rule: **a value computed from the model's inputs, buffers and constants alone (no parameter on
its way) never crosses a cut: each stage that reads it computes it again** from the model inputs
(which every rank rebuilds itself) and its own copies of the buffers, with the graph's own
operations, so it is the same value. Hugging Face decoders are the case in point: their causal
attention mask (B x 1 x S x S, bool, under sdpa), position ids and rotary cos/sin tables are made
once before the first layer and read by every layer; sending them would put a mask of S² per
sample on every cut. Then the cut carries the hidden states (and what really flows from the
layers), and the profile's cut bytes are those.

Not recomputed (they cross as usual): a value with a parameter on its way (frozen or not), one
made by a random operation (dropout, rand, bernoulli, ...: another draw would differ), one that
writes in place or whose storage something writes in place (a recomputation would not see the
write), and anything computed by a called submodule (fx leaf modules: their state is theirs).
What it costs: each stage reading such a value runs its operations again once per micro-batch
(index arithmetic and a comparison for a mask, a few elementwise operations for rotary tables).
"""
from __future__ import annotations

import operator
from typing import Set

from torch import fx, nn

from planner.model.inplace import operation_name, storage_roots, writes

# names of operations whose result is a random draw (aten names and torch functions alike)
_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential",
                 "cauchy", "geometric", "randperm")


def _is_random(node: fx.Node) -> bool:
    name = operation_name(node).lower()
    return any(word in name for word in _RANDOM_WORDS)


def recomputable_nodes(gm: fx.GraphModule) -> Set[str]:
    """Names of the computed nodes (call_function / call_method) of `gm` whose values follow the
    module docstring's rule: computed from inputs, buffers and constants alone."""
    roots = storage_roots(gm.graph, gm)
    every = writes(gm.graph, gm)
    writers = {write.node for write in every}
    written = {roots.get(write.written, write.written) for write in every}
    free: Set[fx.Node] = set()  # nodes made of inputs, buffers and constants
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ok = True
        elif node.op == "get_attr":
            ok = not isinstance(operator.attrgetter(str(node.target))(gm), nn.Parameter)
        elif node.op in ("call_function", "call_method"):
            ok = (all(source in free for source in node.all_input_nodes) and not _is_random(node)
                  and node not in writers)
        else:
            ok = False
        if ok and roots.get(node, node) not in written:
            free.add(node)
    return {node.name for node in free if node.op in ("call_function", "call_method")}


def needed_inputs(gm: fx.GraphModule, recomputed: Set[str], wanted: Set[fx.Node]) -> Set[str]:
    """The model inputs (placeholder names) that computing the `wanted` recomputable nodes reads."""
    inputs: Set[str] = set()
    stack, seen = list(wanted), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            inputs.add(node.name)
        elif node.name in recomputed:
            stack.extend(node.all_input_nodes)
    return inputs

