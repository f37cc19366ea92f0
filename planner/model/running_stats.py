"""Units whose training forward writes state in place: a normalisation's running statistics, an EMA or
a step counter kept in a buffer (`mean.mul_(0.9).add_(...)`, `steps += 1`), the power-iteration vectors
of spectral norm, an embedding's rows renormalised to `max_norm` (planner.model.inplace finds the writes).

Rule: a stage holding one cannot be replicated (PipeDream-style stage replicas, `planner solve
--replicate`): each replica would see only its own micro-batches and write its own copy, so no one
state equals single-process training (where the forward reads the state, not even the gradients). The
profile marks such units (`UnitProfile.running_stats`), the solver keeps them on one device per
data-parallel replica, and the runtime refuses a plan that replicates one (runtime.stage).
Data-parallel replicas are a different matter: each keeps its own state, as DDP without SyncBatchNorm
does, and the saved state is replica 0's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Set

from planner.model.inplace import state_written_by, storage_roots, writes

if TYPE_CHECKING:
    from planner.model.capture import CapturedModel


def state_writers(captured: "CapturedModel") -> Set[int]:
    """The units of `captured` whose forward writes a parameter or buffer in place: a graph operation
    writing into one (or a view of it), or a call of a module that, or a submodule of which, writes its
    own (`state_written_by`)."""
    gm = captured.gm
    unit_of = {node: k for k, unit in enumerate(captured.units) for node in unit.nodes}
    roots = storage_roots(gm.graph, gm)
    found = {unit_of[w.node] for w in writes(gm.graph, gm)
             if w.node in unit_of and roots.get(w.written, w.written).op == "get_attr"}
    found |= {unit_of[node] for node in gm.graph.nodes if node.op == "call_module" and node in unit_of and
              any(state_written_by(m) for m in gm.get_submodule(str(node.target)).modules())}
    return found
