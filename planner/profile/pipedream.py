"""Import PipeDream's published layer profiles (profiler/*/profiles/<model>/graph.txt) as profiles.

Format: one node a line, `nodeN -- description -- forward_compute_time=F, backward_compute_time=G,
activation_size=A, parameter_size=P` (ms for one minibatch; bytes; A may be a list `[a; b; c]`, one
entry per output), then one edge a line, tab-indented: `nodeA -- nodeB`.

Conversion, at the one micro-batch size B the graph was measured at:
- one unit per node, in a topological order of the DAG (Kahn's algorithm, ties broken by the
  order of the file), named by its node name; forward_s = F / 1000, backward_s = G / 1000,
  param_bytes = P, output_bytes = sum(A);
- saved_bytes = sum(A): PipeDream records only each layer's output, so the activation a unit keeps
  for backward is assumed to be its output (an approximation: e.g. a ReLU in place keeps less, a
  convolution keeps its input, which is its producer's output);
- `Input` nodes cost nothing (times, parameters and saved bytes 0), as PipeDream's optimizer treats
  them, and their outputs never cross a cut: as everywhere in this project, every rank rebuilds the
  batch itself;
- cut k is crossed by every output of a node at position < k consumed by a node at position >= k
  (one tensor value per output of the producer, `nodeN` or `nodeN:i`, with requires_grad).
"""
from __future__ import annotations

import heapq
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Tuple

from planner.jsonio import not_a_regular_file
from planner.profile.cut_profile import CutProfile, CutValue
from planner.profile.profile import Profile
from planner.profile.unit_profile import UnitProfile

_METRICS = re.compile(r"(\w+)=(\[[^\]]*\]|[-+0-9.eE]+)")


@dataclass
class GraphNode:
    name: str
    description: str
    forward_ms: float
    backward_ms: float
    activation_sizes: List[float]
    parameter_bytes: float

    @property
    def is_input(self) -> bool:
        return self.description.startswith("Input")


def _sizes(text: str) -> List[float]:
    text = text.strip()
    if text.startswith("["):
        return [float(x) for x in text[1:-1].split(";") if x.strip()]
    return [float(text)]


def parse_graph(text: str, where: str = "graph") -> Tuple[List[GraphNode], List[Tuple[str, str]]]:
    """Nodes (in file order) and edges of a PipeDream graph.txt; ValueError naming the bad line."""
    nodes: List[GraphNode] = []
    edges: List[Tuple[str, str]] = []
    named = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.strip().split(" -- ")
        if line.startswith("\t") or (len(fields) == 2 and "=" not in line):
            if len(fields) != 2:
                raise ValueError(f"{where} line {number}: an edge must read 'nodeA -- nodeB'")
            edges.append((fields[0].strip(), fields[1].strip()))
            continue
        if len(fields) < 3:
            raise ValueError(f"{where} line {number}: a node must read 'name -- description -- metrics'")
        metrics = dict(_METRICS.findall(fields[-1]))
        try:
            nodes.append(GraphNode(name=fields[0].strip(), description=" -- ".join(fields[1:-1]).strip(),
                                   forward_ms=float(metrics["forward_compute_time"]),
                                   backward_ms=float(metrics["backward_compute_time"]),
                                   activation_sizes=_sizes(metrics["activation_size"]),
                                   parameter_bytes=float(metrics["parameter_size"])))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where} line {number}: missing or bad metric ({e})") from None
        node = nodes[-1]
        if node.name in named:
            raise ValueError(f"{where} line {number}: node {node.name!r} is named twice; each node needs its own name")
        named.add(node.name)
        numbers = [node.forward_ms, node.backward_ms, node.parameter_bytes] + node.activation_sizes
        if not all(0 <= x < 1e18 for x in numbers):  # NaN fails too
            raise ValueError(f"{where} line {number}: times and sizes must be finite and >= 0")
    if not nodes:
        raise ValueError(f"{where} has no nodes")
    known = {n.name for n in nodes}
    for a, b in edges:
        if a not in known or b not in known:
            raise ValueError(f"{where}: edge {a} -- {b} names an unknown node")
    return nodes, edges


def topological_order(nodes: List[GraphNode], edges: List[Tuple[str, str]]) -> List[int]:
    """Node indices in a topological order, smallest file position first among the ready ones."""
    index = {n.name: i for i, n in enumerate(nodes)}
    indegree = [0] * len(nodes)
    successors: Dict[int, List[int]] = {i: [] for i in range(len(nodes))}
    for a, b in edges:
        successors[index[a]].append(index[b])
        indegree[index[b]] += 1
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle; PipeDream graphs are DAGs")
    return order


def graph_to_profile(nodes: List[GraphNode], edges: List[Tuple[str, str]], batch_size: int, model_name: str
                     ) -> Profile:
    """The profile of the graph at micro-batch size `batch_size` (the conversion in the module docstring)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be positive (got {batch_size})")
    B = batch_size
    order = topological_order(nodes, edges)
    position = {nodes[i].name: p for p, i in enumerate(order)}
    units = []
    for i in order:
        n = nodes[i]
        zero = n.is_input
        size = 0 if zero else int(round(sum(n.activation_sizes)))
        units.append(UnitProfile(name=n.name, param_bytes=0 if zero else int(round(n.parameter_bytes)),
                                 forward_s={B: 0.0 if zero else n.forward_ms / 1e3},
                                 backward_s={B: 0.0 if zero else n.backward_ms / 1e3},
                                 saved_bytes={B: size}, output_bytes={B: size}, nodes=[n.name]))
    last_use: Dict[str, int] = {}
    for a, b in edges:
        last_use[a] = max(last_use.get(a, -1), position[b])
    crossing: List[List[CutValue]] = [[] for _ in range(len(order))]  # crossing[k]: values over cut k
    for i in order:
        n = nodes[i]
        if n.is_input or n.name not in last_use:
            continue
        sizes = [int(round(s)) for s in n.activation_sizes]
        values = [CutValue(name=n.name if len(sizes) == 1 else f"{n.name}:{j}", kind="tensor", dtype="float32",
                           requires_grad=True, shape={B: [s // 4]}, bytes={B: s}) for j, s in enumerate(sizes)]
        for k in range(position[n.name] + 1, last_use[n.name] + 1):
            crossing[k].extend(values)
    cuts = [CutProfile(before_unit=k, values=crossing[k]) for k in range(1, len(order))]
    return Profile(model={"entry": f"pipedream:{model_name}", "args": {}, "seed": 0}, micro_batch_sizes=[B],
                   units=units, cuts=cuts, device="gpu", device_name="pipedream-published", threads=1,
                   dtype="float32", torch_version="", capture="pipedream", repeats=1)


def import_pipedream(path: str, batch_size: int) -> Profile:
    """Read graph.txt at `path` and convert it (ValueError with the line on malformed input)."""
    kind = not_a_regular_file(path)
    if kind:
        raise ValueError(f"PipeDream graph {path!r} is {kind}; pass a graph.txt file")
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read PipeDream graph {path!r}: {getattr(e, 'strerror', None) or e}") from None
    name = os.path.basename(path).split(".")[0] or "model"
    nodes, edges = parse_graph(text, where=path)
    return graph_to_profile(nodes, edges, batch_size, name)
