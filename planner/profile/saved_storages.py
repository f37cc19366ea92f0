"""The storages a unit's forward saves, each named by the value it holds: those other units may
save too, those its weight part keeps, those it keeps when recomputed, those autograd frees at once;
what it saves and holds as a stage's first unit, its inputs each in a storage of its own; and what it
holds where its stage computes values it reads from parameters (`inner_counts`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from planner.profile.profile_run import InnerSources, ProfileRun
from planner.profile.records import as_received, tensor_bytes
from planner.profile.saved import SavedBytes
from planner.profile.splitgrad import backward_weight, first_part, forward_and_input_part
from planner.profile.timing import UnitCall, _closures, _InputRestore


def inner_counts(call: UnitCall, k: int, received: List[str], sent: List[str], values: Dict[str, Any], held: int,
                 kept: int, loss_fn, target: Any, graph: InnerSources
                 ) -> Tuple[Dict[str, int], Dict[str, int], Dict[str, int], Dict[str, int]]:
    """Unit k's (UnitProfile.) inner_weight_bytes, inner_kept_bytes, inner_seed_bytes and inner_seed_sources.

    The first: {source T: bytes}, what its weight part holds more (less) in a stage starting at a than `held`,
    measured alone, is the sum of those with T >= a; the second the same of the gradients it keeps, of which
    `kept` alone. A received value of source T >= a (with 1 <= T: a stage starting at 0 is whole) is computed
    in such a stage from its parameters and carries no gradient from its inputs: the nodes where it meets them
    keep theirs for the weight part (a shared position bias added to every block's scores). Measured with those
    values' gradients asked for in the weight part, as parameters' are, at each source in turn. The third: of
    its outputs (`sent` names, `values` their tensors) those made from its parameters alone (their source is
    k), whose gradients it keeps alone (as seeds) and a stage holding all their readers does not; and those made
    from received values too, all of one source T < k (a text tower's layers, computed from token ids): measured
    with the values of source >= T left to the weight part, it keeps their gradients (in inner_kept_bytes[T]),
    which such a stage does not either. The fourth: those outputs' sources T < k, by name."""
    offset = len(call.args) - len(received)  # the received values follow the model's inputs
    sources: Dict[int, List[torch.Tensor]] = {}
    for i, name in enumerate(received):
        source, arg = graph.sources.get(name, 0), call.args[offset + i]
        if graph.first_input <= source < k and isinstance(arg, torch.Tensor) and arg.requires_grad:
            sources.setdefault(source, []).append(arg)
    seeds = {name: tensor_bytes(values[name]) for name in sent
             if graph.sources.get(name) == k and graph.grad_flags.get(name) and isinstance(values[name], torch.Tensor)}
    seed_sources: Dict[str, int] = {}
    out: Dict[str, int] = {}
    out_kept: Dict[str, int] = {}
    forward, _ = _closures(call, loss_fn, target)
    trainable, outside = call.trainable(), []
    for source in sorted(sources, reverse=True):  # a stage starting at `source` computes all these
        outside = outside + sources[source]
        seeded: List[str] = []  # the outputs whose gradients it keeps as seeds (names only: no tensor kept alive)

        def part(result, outside=outside, seeded=seeded):
            pending = first_part(call, result, trainable + outside, outside=outside)
            if not call.is_last:
                kept_outputs = {id(t) for group in pending.groups for t in group.seeds}
                seeded.extend(name for name, i in zip(sent, call.produced) if id(result[i]) in kept_outputs)
            return pending

        with torch.enable_grad():
            pending, inside, inside_kept = forward_and_input_part(forward, part, list(call.module.parameters()))
            backward_weight(pending)
        for name in seeded:  # made from values of this source (and its parameters): kept from here on
            if graph.sources.get(name) == source and graph.grad_flags.get(name) and name not in seeds:
                seeds[name], seed_sources[name] = tensor_bytes(values[name]), source
        call.module.zero_grad(set_to_none=True)
        for arg in outside:
            arg.grad = None
        _InputRestore(call)()
        if inside != held or inside_kept != kept:
            out[str(source)], out_kept[str(source)] = inside - held, inside_kept - kept
        held, kept = inside, inside_kept
    return out, out_kept, seeds, seed_sources


def as_first(run: ProfileRun, call: UnitCall, target: Any) -> Optional[Tuple[int, int, Set[int]]]:
    """(saved bytes, bytes held from its input part to its weight part, the indices of the arguments whose
    storage it saves) of a unit run as a stage's first, its inputs each in a storage of its own
    (`as_received`); None where that is how it runs inside a stage too. One more forward, and one with its
    input part."""
    received = as_received(call.args)
    if received is None:
        return None
    first = UnitCall(call.module, received, call.produced, call.is_last, call.params, call.grad_orders)
    forward, _ = _closures(first, run.spec.loss, target)
    counter = SavedBytes(call.module.parameters())
    with torch.enable_grad():
        with counter.counting():
            result = forward()
        saved = counter.finish()
        stored = counter.saved_storage_bytes()
        own = {i for i, arg in enumerate(received) if isinstance(arg, torch.Tensor) and
               arg.untyped_storage().data_ptr() in stored}
        del result
        trainable = call.trainable()
        pending, held, _ = forward_and_input_part(forward, lambda out: first_part(first, out, trainable),
                                                  list(call.module.parameters()))
        backward_weight(pending)
    call.module.zero_grad(set_to_none=True)
    return saved, held, own


def received_parts(args: List[Any], names: List[str], storage_names: Dict[int, str]) -> Dict[str, Dict[str, int]]:
    """{X: {v: bytes}}: the storages two or more of the arguments view, or one views part of, by their name
    X (`storage_names`: data pointer -> name), each argument v (`names`, aligned with `args`) viewing one
    with the bytes of v alone, as a stage starting with the unit receives it (UnitProfile.received_parts)."""
    groups: Dict[int, List[int]] = {}
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.layout == torch.strided and arg.untyped_storage().data_ptr():
            groups.setdefault(arg.untyped_storage().data_ptr(), []).append(i)
    out: Dict[str, Dict[str, int]] = {}
    for ptr, members in groups.items():
        whole = args[members[0]].untyped_storage().nbytes()
        if (len(members) > 1 or whole > tensor_bytes(args[members[0]])) and ptr in storage_names:
            out[storage_names[ptr]] = {names[i]: tensor_bytes(args[i]) for i in members}
    return out


class _StorageNames(torch.fx.Interpreter):
    """Runs a unit node by node, naming each storage a value occupies after the first node that
    produced it (a view is its base's), or after a `shareable` value it holds (an in-place op's
    result sent on by that name): `names` {data pointer: node name}. Every value stays referenced
    until `forget`: a freed value's address taken by a later one would give that one its name."""

    def __init__(self, module: torch.fx.GraphModule, shareable: Set[str]):
        super().__init__(module)
        self.shareable, self.names = shareable, {}
        self.values: List[torch.Tensor] = []

    def forget(self) -> None:
        """Drop the run's values (they hold their autograd nodes)."""
        self.env.clear()
        self.values.clear()

    def run_node(self, node):
        result = super().run_node(node)
        for value in (result if isinstance(result, (tuple, list)) else (result,)):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr():
                self.values.append(value)
                ptr = value.untyped_storage().data_ptr()
                if ptr not in self.names or (node.name in self.shareable and self.names[ptr] not in self.shareable):
                    self.names[ptr] = node.name
        return result


def _apart(args: List[Any]) -> List[Any]:
    """The arguments, each one that is all of a storage an argument before it holds too in a storage of
    its own. Received across a cut (a value and an alias of it, `h` and `h.detach()`), they arrive as two
    messages, two storages: what two units save through them must not be named as one, or a stage
    starting there holds both where the plan counts one (inside a stage it is one: over-planned). A view
    of part of a storage, or a broadcast one, stays: a copy would save another number of bytes (the
    stage's first unit is measured as received: `as_first`)."""
    seen, out = set(), []
    for a in args:
        if isinstance(a, torch.Tensor) and a.layout == torch.strided and a.untyped_storage().data_ptr():
            key = a.untyped_storage().data_ptr()
            whole = a.is_contiguous() and a.untyped_storage().nbytes() == a.numel() * a.element_size()
            if key in seen and whole:
                a = a.detach().clone().requires_grad_(a.requires_grad)
            seen.add(key)
        out.append(a)
    return out


def shared_saved(run: ProfileRun, work: List[UnitCall], target: Any
                 ) -> List[Tuple[Dict[str, int], Dict[str, int], Dict[str, int], Dict[str, int], Dict[str, Dict]]]:
    """Per unit, the storages its forward saves that hold a value other units may save too
    (UnitProfile.shared_saved_bytes), by that value's name: its inputs, its outputs for later
    units, and values every stage computes again; and of them, those it still holds after its input
    part (UnitProfile.weight_shared_bytes: a zero-bubble stage's last unit); the storages of its
    arguments, which it keeps when recomputed (UnitProfile.recomputed_shared_bytes); and the storages it
    saves that autograd frees as the forward returns, its outputs held (UnitProfile.dropped_saved_bytes,
    by the same names, "" for the rest); and the storages its arguments view apart (`received_parts`).
    One more forward of each unit (`_StorageNames`), and its input part."""
    out = []
    for k, call in enumerate(work):
        _, io = run.stages[k]
        shareable = set(io.inputs) | set(io.received) | set(io.sent) | \
            {n.name for n in call.module.graph.nodes if n.name in run.captured.recomputed}
        naming, args = _StorageNames(call.module, shareable), _apart(call.args)
        counter, restore = SavedBytes(call.module.parameters()), _InputRestore(call)  # (the inputs before it runs)
        with torch.enable_grad():
            with counter.counting():
                with run.forwarding():  # the interpreter does not call the module's forward
                    result = naming.run(*args)
                if call.is_last:
                    result = run.spec.loss(result, target)
            shared = {naming.names[ptr]: size for ptr, size in counter.saved_storage_bytes().items()
                      if naming.names.get(ptr) in shareable}
            parts = received_parts(args, list(io.inputs) + list(io.received), naming.names)
            # recomputed, it keeps its tensor arguments (runtime.stage's checkpoint saves them all)
            kept = {}
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() in naming.names:
                    storage = arg.untyped_storage()
                    kept[naming.names[storage.data_ptr()]] = storage.nbytes()
            held: Dict[str, int] = {}
            refs = counter.saved_refs()
            naming.forget()  # the interpreter's values would keep their nodes alive
            # what no node its outputs reach saves: freed now (a storage once, whichever of its packs lives)
            alive = {ptr for ref, ptr, _ in refs if ref() is not None}
            dropped: Dict[str, int] = {}
            for ptr, size in counter.saved_storage_bytes().items():
                if ptr not in alive:
                    name = naming.names.get(ptr) if naming.names.get(ptr) in shared else ""
                    dropped[name] = dropped.get(name, 0) + size
            if shared and k > 0:  # which of them the weight part keeps
                pending = first_part(call, result, call.trainable())
                del result
                alive = {ptr for ref, ptr, _ in refs if ref() is not None}
                held = {naming.names[ptr]: shared[naming.names[ptr]] for ptr in alive
                        if naming.names.get(ptr) in shared}
                backward_weight(pending)
                call.module.zero_grad(set_to_none=True)
        naming.forget()
        restore()
        out.append((shared, held, kept, dropped, parts))
    return out
