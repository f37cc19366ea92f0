"""Bytes autograd saves for backward, counted as it packs them: the activation memory of the plans.

Each storage counts once and parameters not at all (they are memory of their own). The profile
counts what one unit's forward saves; every rank counts what each micro-batch's forward saves,
adds it while the micro-batch waits for its backward and keeps the peak, which the plan's memory
model predicts.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_map_only


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether a tensor is a sharded parameter (a DTensor, runtime/shard_params.py): it has a local shard."""
    return hasattr(tensor, "to_local")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What holds a tensor's storage on this process: a sharded parameter's local shard, else the
    tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


class Packed:
    """What a counting pack hook hands autograd: an alias of the saved tensor without its graph, and
    the version it was saved at. The tensor itself would tie a saved output to the node saving it
    (node -> saved tensor -> its grad_fn, the node): a cycle nothing collects, so a graph dropped
    without a backward that frees it (the loss's, after a zero-bubble input part) would stay in
    memory, and be counted as held. Autograd does not check what a hook packed against in-place
    writes, so `unpack` does (the alias shares the tensor's version counter): a forward that writes
    a saved tensor fails in the counted step as it fails without hooks, not trains on other values."""
    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{self.tensor.type()} {list(self.tensor.shape)}] is at version {self.tensor._version}; expected "
                f"version {self.version} instead (write a copy, or do the in-place operation after the backward)")
        return self.tensor


def unpack(saved: Packed) -> torch.Tensor:
    """The unpack hook of `Packed`."""
    return saved.unpack()


class SavedBytes:
    """`with counter.counting(): forward()` then `counter.finish()`: the bytes that forward saved,
    now held (`live`; `peak` is the most held at once) until `release(those bytes)`."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self.parameter_ptrs = {local_tensor(p).untyped_storage().data_ptr() for p in params}
        self.excluded_ptrs: set = set()  # other tensors held for the whole step (`exclude`)
        self.apart_ptrs: set = set()  # tensors held for the whole run, not by a micro-batch (`hold_apart`)
        self.live = 0
        self.peak = 0
        self._storages: Dict[int, int] = {}
        self._refs: List[Tuple[weakref.ref, int, int]] = []  # (what was packed, its storage, bytes)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count what the forward in this block saves (saved-tensor hooks)."""
        self._storages, self._refs = {}, []
        with torch.autograd.graph.saved_tensors_hooks(self._pack, unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> Packed:
        alias = Packed(tensor)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.parameter_ptrs and ptr not in self.excluded_ptrs:
            self._storages[ptr] = storage.nbytes()
            self._refs.append((weakref.ref(alias), ptr, storage.nbytes()))
        return alias

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these as parameters too (replacing the last call's): the step's compute copies of
        the weights (planner.model.precision), held once per step, not per micro-batch."""
        self.excluded_ptrs = {t.untyped_storage().data_ptr() for t in tensors}

    def hold_apart(self, tensor: torch.Tensor) -> None:
        """`tensor` is held for the whole run, not by a micro-batch that keeps it (the engine's loss
        seed: a zero-bubble stage whose inputs need no gradient keeps it until its weight part)."""
        self.apart_ptrs.add(tensor.untyped_storage().data_ptr())

    def saved_storages(self) -> set:
        """Data pointers of the storages the last counted forward saved (parameters excluded)."""
        return set(self._storages)

    def saved_storage_bytes(self) -> Dict[int, int]:
        """{data pointer: bytes} of the storages the last counted forward saved (parameters excluded)."""
        return dict(self._storages)

    def saved_refs(self) -> List[Tuple[weakref.ref, int, int]]:
        """What the last counted forward saved, as weak references: `held_now` tells which autograd
        still holds."""
        return list(self._refs)

    def held_now(self, refs: List[Tuple[weakref.ref, int, int]], kept: Iterable[torch.Tensor]) -> int:
        """The bytes of the storages among `refs` that autograd still holds, and of `kept` (a split
        backward's kept gradients, planner.profile.splitgrad), each storage once, parameters not."""
        storages = {ptr: nbytes for ref, ptr, nbytes in refs if ref() is not None}
        for tensor in kept:
            storage = tensor.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in self.parameter_ptrs | self.apart_ptrs:
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def hold(self, held: int) -> None:
        """`held` more bytes are held from now on (until `release(held)`)."""
        self.live += held
        self.peak = max(self.peak, self.live)

    def finish(self) -> int:
        """The bytes the last counted forward saved; they are held from now on."""
        held = sum(self._storages.values())
        self.live += held
        self.peak = max(self.peak, self.live)
        return held

    def release(self, held: int) -> None:
        """A backward ran: what its forward saved is freed."""
        self.live -= held


def held_beside_loss(values: Dict[str, Any], last_io: Any, module: torch.nn.Module) -> List[Any]:
    """What a rank holds anyway where `loss_saved_bytes` counts (the last unit recomputed): the last unit's
    arguments (`last_io`'s inputs and received values, from one run's `values`), the model's parameters and
    buffers."""
    return [values[n] for n in list(last_io.inputs) + list(last_io.received)] + list(module.parameters()) \
        + list(module.buffers())


def loss_saved_bytes(loss: Callable[[Any, Any], Any], output: Any, target: Any, kept: Iterable[Any] = (),
                     key: Callable[[torch.Tensor], int] = lambda t: t.untyped_storage().data_ptr()) -> int:
    """The bytes `loss` saves for backward on `output` as a last stage hands it over (each storage the
    output's tensors view copied afresh, their views kept: a loss saving a slice of a larger value keeps
    all of it) and `target`, each storage once (`key`: its identity; a meta tensor needs another than its
    data pointer), less those of `kept`'s tensors (the last unit's arguments, the model's parameters and
    buffers: held anyway where the loss counts, the last unit recomputed, so a view of one costs nothing
    more). Parameters it saves are not counted (a rank holds them anyway)."""
    held = {key(t) for t in tree_leaves(kept) if isinstance(t, torch.Tensor)}
    copies: Dict[int, torch.Tensor] = {}  # an output storage's key -> a tensor on its fresh copy

    def handed_over(t: torch.Tensor) -> torch.Tensor:
        if key(t) in held:
            fresh = t.detach()  # the very storage the recomputed unit keeps
        else:
            if key(t) not in copies:
                copies[key(t)] = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage().clone())
            base = copies[key(t)]
            fresh = torch.empty(0, dtype=t.dtype, device=t.device).set_(base.untyped_storage(), t.storage_offset(),
                                                                        t.size(), t.stride())
        return fresh.requires_grad_(t.is_floating_point() or t.is_complex())

    fresh_output = tree_map_only(torch.Tensor, handed_over, output)
    saved: Dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> Packed:
        if not isinstance(tensor, torch.nn.Parameter) and key(tensor) not in held:
            saved[key(tensor)] = tensor.untyped_storage().nbytes()
        return Packed(tensor)

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss(fresh_output, target)
    return sum(saved.values())
