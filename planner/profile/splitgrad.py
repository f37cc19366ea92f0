"""A stage's backward in two parts: the input gradients now, the weight gradients later (zero-bubble
schedules' `backward_input` and `backward_weight`), with no autograd node run twice for one output.

The backward graph of one micro-batch, from the stage's outputs (or its loss) down to its inputs
and parameters, splits at the *frontier*: the nodes that lie on a path to an input (so the input
backward runs them) and from which a parameter is reached through nodes that do not. Rules:

- `backward_input` runs autograd towards the inputs only (each node computes just the outputs a
  path to an input needs: a matmul's input gradient, not its weight gradient), sets each input's
  `.grad`, and keeps the gradients that arrived at every frontier node (a view of a larger storage,
  a concatenation's, as a copy: `own_storage`), plus each output that reaches no input at all (a
  first stage's outputs, a branch off the inputs) with its gradient.
- `backward_weight` runs autograd from those kept gradients to the parameters and accumulates the
  result into their `.grad` as a whole backward would (post-accumulate hooks included), freeing the
  graph. A frontier node runs again there for its parameter-side
  outputs only; a frontier node below another frontier node takes its kept gradient, not the sum
  (a pre-hook replaces what arrives), so nothing is counted twice.
- Where no input needs a gradient (a first stage), the input part runs nothing and the weight part
  is one whole backward from the outputs.
- Each parameter group costs the weight part one autograd call, and each call walks the graph below
  its frontier (torch's engine finds what leads to the parameters from the whole graph below its
  roots); the profile times both parts per unit and what a stage pays on top
  (planner.profile.run_timing).
- Between the two, the micro-batch holds what the frontier's subgraph saved (a matmul's input,
  say); the rest of its graph is released once nothing references it.
- A checkpointed (recomputed) region recomputes its forward in each part that reads what it saved:
  a frontier node unpacks all its saved tensors in the input backward, and torch's checkpoint lets
  each saved tensor be unpacked once per recomputation, so the weight backward recomputes again
  (the cost model charges a recomputed unit's forward to both parts).
"""
from __future__ import annotations

import collections
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node

from planner.profile.analytic import saved_key
from planner.profile.saved import Packed, unpack
from planner.profile.timing import UnitCall, _closures, _InputRestore, backward_seeds, sync

# autograd's engine, called without torch.autograd.backward / grad's Python checks: the gradients
# passed here come from autograd itself (their shapes are right), and the checks cost about 20 us
# per call, which the weight part pays once per parameter group (BENCHMARKS.md). torch's own thin
# entry where it has one (it hands the caller's context to the engine's device threads)
_ENGINE_RUN = getattr(torch.autograd.graph, "_engine_run_backward", None) or \
    torch.autograd.Variable._execution_engine.run_backward


def _run_backward(roots: Sequence[object], grads: Sequence[torch.Tensor], keep_graph: bool,
                  inputs: Sequence[torch.Tensor], accumulate: bool) -> tuple:
    """Autograd from `roots` (tensors or GradientEdges) seeded with `grads` to `inputs` only:
    accumulated into their `.grad` (as torch.autograd.backward(..., inputs=)) or returned, None
    where unreached (as torch.autograd.grad(..., allow_unused=True))."""
    return _ENGINE_RUN(tuple(roots), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)


def _node_of(tensor: torch.Tensor) -> Optional[Node]:
    """The autograd node a tensor's gradient enters: its grad_fn, or a leaf's gradient accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if tensor.requires_grad:  # a leaf: its accumulator, reached through a throwaway view
        return tensor.view_as(tensor).grad_fn.next_functions[0][0]
    return None


def _consumers(roots: Sequence[Node]) -> Dict[Node, List[Node]]:
    """Reverse edges of the graph below `roots`: node -> the nodes whose backward feeds it."""
    consumers: Dict[Node, List[Node]] = collections.defaultdict(list)
    seen: Set[Node] = set(roots)
    queue = collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _above(starts: Sequence[Node], consumers: Dict[Node, List[Node]], stop: Set[Node]
           ) -> Tuple[Set[Node], Set[Node]]:
    """(nodes passed, nodes of `stop` met) walking up from `starts` (which count as passed); the
    walk does not go on past a node of `stop`."""
    found: Set[Node] = set()
    seen: Set[Node] = set(starts)
    queue = collections.deque(starts)
    while queue:
        node = queue.popleft()
        for parent in consumers.get(node, ()):
            if parent in seen:
                continue
            seen.add(parent)
            if parent in stop:
                found.add(parent)
            else:
                queue.append(parent)
    return seen - found, found


@dataclass
class _Group:
    """Parameters whose weight backward starts from the same kept gradients: one autograd call,
    which runs nothing outside their own subgraph."""

    params: List[torch.Tensor] = field(default_factory=list)
    frontier: List[Node] = field(default_factory=list)
    seeds: List[torch.Tensor] = field(default_factory=list)  # outputs reaching no input ...
    seed_grads: List[torch.Tensor] = field(default_factory=list)  # ... and their gradients


@dataclass
class PendingWeights:
    """What a micro-batch keeps from its input backward for its weight backward."""

    groups: List[_Group] = field(default_factory=list)
    kept: Dict[Node, tuple] = field(default_factory=dict)  # frontier node -> the gradients it received
    graph_nodes: int = 0  # autograd nodes below the outputs (what each weight call may walk); 0: not analysed

    def kept_gradients(self) -> List[torch.Tensor]:
        return [g for grads in self.kept.values() for g in grads if g is not None] + \
            [g for group in self.groups for g in group.seed_grads]


def _groups(params: Sequence[Tuple[torch.Tensor, Node]], consumers: Dict[Node, List[Node]], on_input_path: Set[Node],
            seeds: Dict[Node, Dict[int, Tuple[torch.Tensor, torch.Tensor]]]) -> List[_Group]:
    """The parameters (each with the node its gradient enters) grouped by the subgraphs above them up
    to the input path (one walk up from all of them: a node reached from two parameters joins their
    groups), with each group's frontier nodes and seed outputs."""
    leader = list(range(len(params)))

    def find(i: int) -> int:
        while leader[i] != i:
            leader[i] = leader[leader[i]]
            i = leader[i]
        return i

    owner: Dict[Node, int] = {}
    queue: collections.deque = collections.deque()
    for i, (_, node) in enumerate(params):
        if node in owner:
            leader[find(i)] = find(owner[node])
        else:
            owner[node] = i
            queue.append(node)
    while queue:
        node = queue.popleft()
        for parent in consumers.get(node, ()):
            if parent in owner:
                leader[find(owner[node])] = find(owner[parent])
                continue
            owner[parent] = owner[node]
            if parent not in on_input_path:
                queue.append(parent)
    groups: Dict[int, _Group] = {}
    for i, (p, _) in enumerate(params):
        groups.setdefault(find(i), _Group()).params.append(p)
    for node, i in sorted(owner.items(), key=lambda item: item[1]):
        if node in on_input_path:
            groups[find(i)].frontier.append(node)
        elif node in seeds:
            for tensor, grad in seeds[node].values():
                groups[find(i)].seeds.append(tensor)
                groups[find(i)].seed_grads.append(grad)
    return list(groups.values())


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> PendingWeights:
    """Gradients of `inputs` (added to their `.grad`) from `outputs` with `grads` (None: ones, for a
    loss); returns what `backward_weight` needs for `params`, the stage's trainable parameters
    (requires_grad: listed once by the caller, as a check per parameter costs a first stage's input
    part most of its time) (module docstring)."""
    pairs = [(t, torch.ones_like(t) if g is None else g) for t, g in zip(outputs, grads) if t.requires_grad]
    for t, g in pairs:  # an input passed on unchanged (a skip crossing this stage): its gradient as is
        if t.grad_fn is None:
            t.grad = g if t.grad is None else t.grad + g
    pairs = [(t, g) for t, g in pairs if t.grad_fn is not None]
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanted:  # no input part (a first stage): the weight part is one whole backward, no analysis
        whole = _Group(params=list(params), seeds=[t for t, _ in pairs],
                       seed_grads=[g for _, g in pairs])
        return PendingWeights(groups=[whole] if whole.params and whole.seeds else [])
    consumers = _consumers([t.grad_fn for t, _ in pairs])
    trainable = [(p, node) for p, node in ((p, _node_of(p)) for p in params)
                 if node in consumers]  # those this graph uses, with the node each one's gradient enters
    input_nodes = [n for n in (_node_of(t) for t in wanted) if n is not None and n in consumers]
    # the nodes the input backward runs: every node from which an input is reached
    on_input_path, _ = _above(input_nodes, consumers, stop=set())
    # by node and output: the parts of one multi-output node (a chunk's) are outputs of their own
    seeds: Dict[Node, Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = {}
    for t, g in pairs:
        if t.grad_fn not in on_input_path:
            outputs = seeds.setdefault(t.grad_fn, {})
            if t.output_nr in outputs:  # one output twice: its gradients add up
                outputs[t.output_nr] = (t, outputs[t.output_nr][1] + g)
            else:
                outputs[t.output_nr] = (t, g)
    pending = PendingWeights(groups=_groups(trainable, consumers, on_input_path, seeds),
                             graph_nodes=len(set(consumers) | {t.grad_fn for t, _ in pairs}))
    reached = [t for t in wanted if _node_of(t) in on_input_path]
    if not reached:
        return pending
    handles = []

    def keep(node: Node):
        def hook(grad_outputs):
            pending.kept[node] = tuple(own_storage(g) for g in grad_outputs)
        return hook

    try:
        for group in pending.groups:
            for node in group.frontier:
                handles.append(node.register_prehook(keep(node)))
        found = _run_backward([t for t, _ in pairs if t.grad_fn in on_input_path],
                              [g for t, g in pairs if t.grad_fn in on_input_path], True, reached, accumulate=False)
    finally:
        for handle in handles:
            handle.remove()
    for t, grad in zip(reached, found):
        if grad is not None:
            t.grad = grad if t.grad is None else t.grad + grad
    return pending


def own_storage(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`tensor` in a storage of its own where it views a larger one (a copy), else itself. A kept
    gradient: a concatenation's backward hands each input a narrow view of one gradient, which kept
    as it is would pin all of that storage until the weight part, the other views' bytes included (an
    input's gradient, sent on long before). Sparse and nested tensors have no one storage: as they are."""
    if tensor is None or tensor.layout is not torch.strided or \
            tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def backward_weight(pending: PendingWeights) -> None:
    """The parameters' gradients of one micro-batch from what `backward_input` kept, accumulated
    into their `.grad` as a whole backward does (in place, post-accumulate hooks run), one autograd
    call per group; the micro-batch's graph is freed."""
    calls = []
    for group in pending.groups:
        edges: List[object] = list(group.seeds)
        grads: List[torch.Tensor] = list(group.seed_grads)
        for node in group.frontier:
            for k, grad in enumerate(pending.kept.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, k))
                    grads.append(grad)
        if edges:
            calls.append((group, edges, grads))
    for n, (group, edges, grads) in enumerate(calls):
        handles = [node.register_prehook(lambda _, kept=pending.kept[node]: kept)
                   for node in group.frontier if node in pending.kept]
        try:
            _run_backward(edges, grads, n < len(calls) - 1, group.params, accumulate=True)
        finally:
            for handle in handles:
                handle.remove()
    pending.kept.clear()
    pending.groups.clear()


@dataclass
class BackwardParts:
    """A unit's backward in two parts, medians: seconds of each, of the whole backward in the same
    rounds, and the bytes held between the parts (what the weight part's saved tensors and kept
    gradients occupy, parameters excluded)."""

    input_s: float
    weight_s: float
    whole_s: float
    held_bytes: int
    kept_bytes: int = 0  # of held_bytes, the kept gradients' (the rest: saved tensors still referenced)
    weight_calls: int = 0  # the weight part's autograd calls (parameter groups)
    graph_nodes: int = 0  # autograd nodes of its backward graph (PendingWeights.graph_nodes)

    def shares(self) -> Tuple[float, float]:
        """(input part, weight part) per second of the whole backward: the parts' own overhead
        (graph walks, one autograd call per parameter group) included."""
        if self.whole_s > 0:
            return self.input_s / self.whole_s, self.weight_s / self.whole_s
        both = self.input_s + self.weight_s
        return (self.input_s / both, self.weight_s / both) if both > 0 else (1.0, 0.0)


def forward_and_input_part(forward: Callable[[], object], first_part: Callable[[object], PendingWeights],
                           params: Sequence[torch.Tensor]) -> Tuple[PendingWeights, int, int]:
    """Run `forward()` and `first_part(its result)`, then drop the result: (what the weight part
    needs, the bytes held until it runs: the saved tensors autograd still references and the kept
    gradients, each storage once, parameters excluded; of them, the kept gradients' alone; storages
    named by planner.profile.analytic's `saved_key`, which also names meta tensors')."""
    key = saved_key
    refs: List[weakref.ref] = []

    def pack(tensor: torch.Tensor) -> Packed:
        holder = Packed(tensor)
        refs.append(weakref.ref(holder))
        return holder

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = forward()
    pending = first_part(out)
    del out
    parameters = {key(p) for p in params}
    storages: Dict[int, int] = {}
    alive = [ref() for ref in refs]
    for tensor in [h.tensor for h in alive if h is not None]:
        k = key(tensor)
        if k and k not in parameters:
            storages[k] = tensor.untyped_storage().nbytes()
    kept: Dict[int, int] = {}
    for tensor in pending.kept_gradients():
        k = key(tensor)
        if k and k not in parameters and k not in storages:
            kept[k] = tensor.untyped_storage().nbytes()
    return pending, sum(storages.values()) + sum(kept.values()), sum(kept.values())


def measure_backward_parts(units: Sequence[UnitCall], loss_fn, target, device, repeats: int,
                           warmup: int = 1) -> List[BackwardParts]:
    """Each unit's input and weight backward (`backward_input`, `backward_weight`) timed apart,
    round-robin over the units, each round also timing the unit's whole backward as
    planner.profile.timing.measure_units does (seeded with ones, the loss for the last unit), and
    the bytes held between the two parts."""
    held: List[Tuple[int, int, int, int]] = []
    # listed once, as the runtime's engine does: the trainable ones for the split, all to tell parameters apart
    params = [call.trainable() for call in units]
    for call, own in zip(units, params):  # the held bytes, once
        forward, _ = _closures(call, loss_fn, target)
        pending, size, kept = forward_and_input_part(
            forward, lambda out, call=call, own=own: first_part(call, out, own), list(call.module.parameters()))
        held.append((size, kept, len(pending.groups), pending.graph_nodes))
        backward_weight(pending)
        _InputRestore(call)()
    times: List[List[Tuple[float, float, float]]] = [[] for _ in units]
    steps = [_closures(call, loss_fn, target) + (_InputRestore(call),) for call in units]
    for round_ in range(warmup + max(repeats, 1)):
        for k, (call, (forward, whole, restore)) in enumerate(zip(units, steps)):
            out = forward()
            sync(device)
            t0 = time.perf_counter()
            whole(out)
            sync(device)
            t1 = time.perf_counter()
            restore()
            out = forward()
            sync(device)
            t2 = time.perf_counter()
            pending = first_part(call, out, params[k])
            sync(device)
            t3 = time.perf_counter()
            del out
            backward_weight(pending)
            sync(device)
            t4 = time.perf_counter()
            restore()
            if round_ >= warmup:
                times[k].append((t3 - t2, t4 - t3, t1 - t0))
    for call in units:
        call.module.zero_grad(set_to_none=True)
    return [BackwardParts(*(statistics.median(t[j] for t in ts) for j in range(3)), held_bytes=h, kept_bytes=k,
                          weight_calls=calls, graph_nodes=nodes)
            for ts, (h, k, calls, nodes) in zip(times, held)]


def first_part(call: UnitCall, out, params: Sequence[torch.Tensor], outside: Sequence[torch.Tensor] = ()
               ) -> PendingWeights:
    """The input backward of one unit's forward result (`params`: the unit's trainable ones), seeded
    as measure_units seeds the whole one; `outside`: arguments whose gradients are left to the weight part
    (among `params`), as where its stage computes them (planner.profile.saved_storages.inner_counts)."""
    inputs = [a for a in call.args if isinstance(a, torch.Tensor) and a.requires_grad
              and not any(a is o for o in outside)]
    return backward_input(*backward_seeds(call, out), inputs, params)
