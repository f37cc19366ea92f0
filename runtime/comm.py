"""Point-to-point messages between ranks, posted in batches.

A *message* is what one communication action moves: the tensors crossing a cut for one
micro-batch (activations forward, the gradients of those that need them back). It travels as ONE
tensor whatever its tensor count (a message pays one operation): its only tensor, or else one
byte buffer holding them all, each at a 16-byte-aligned offset. Both ends derive the layout from
the same plan values (`MessageLayout`), so nothing describing the message travels with it, but for
the first message of a kind between two ranks: under autocast the first activation message says its
dtypes (`DescribedLayout`), and the first gradient message says which tensors have a gradient
(`PresenceLayout`). A complex tensor (an FFT's output) travels as its real view (`torch.view_as_real`:
the same bytes, a last dimension of 2), which every transport moves, and is received as a complex
view of such a buffer; in a byte buffer it is just its bytes.

A *batch* is the operations a rank posts together with `torch.distributed.batch_isend_irecv`:
`exchange` waits for every one of them, sends and receives, before it returns; a batch of sends
only is posted and waited for later (runtime.outbox). A send's buffer is free once it has been
waited for: NCCL completes a send only with its matching receive, and on gloo the wait covers the
send too. Tags (gloo matches on
them; NCCL ignores them and matches a pair's operations in issue order) make every message of a
step distinct.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from planner.profile.cut_profile import from_order, shape_in_order, to_order

from planner.profile.cut_profile import MESSAGE_DTYPES

# the dtypes a message carries, as a profile's cut values name them
_DTYPES: Dict[str, torch.dtype] = {name: getattr(torch, name) for name in MESSAGE_DTYPES}
_ALIGN = 16  # bytes: every dtype's view of the byte buffer starts aligned

ACTIVATION, GRADIENT = 0, 1


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"tensor dtype {name!r} cannot be sent between stages") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def message_tag(receiving_stage: int, micro_batch: int, direction: int, num_micro_batches: int) -> int:
    """A tag unique per message within a step: (receiving stage, micro-batch, direction)."""
    return (receiving_stage * num_micro_batches + micro_batch) * 2 + direction


class MessageError(RuntimeError):
    """A stage produced tensors other than the plan says cross its cut."""


class MessageLayout:
    """The tensors of one message ((shape, dtype) each, in the plan's order) and how they sit in
    the one tensor that travels. `orders`: per tensor, the order its dimensions lie in memory
    (planner.profile.cut_profile.dense_order; None: the shape's own): it travels in that order and
    is received as a view of the buffer with those strides, as the sender's stage made it."""

    def __init__(self, tensors: Sequence[Tuple[Tuple[int, ...], torch.dtype]], what: str,
                 orders: Optional[Sequence[Optional[Sequence[int]]]] = None):
        self.tensors = [(tuple(shape), dtype) for shape, dtype in tensors]
        self.orders = [None if o is None else tuple(o) for o in (orders or [None] * len(self.tensors))]
        self.what = what
        self.offsets: List[int] = []
        total = 0
        for shape, dtype in self.tensors:
            total = -(-total // _ALIGN) * _ALIGN
            self.offsets.append(total)
            total += _numel(shape) * _itemsize(dtype)
        self.nbytes = total if len(self.tensors) > 1 else (
            _numel(self.tensors[0][0]) * _itemsize(self.tensors[0][1]) if self.tensors else 0)

    def __len__(self) -> int:
        return len(self.tensors)

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        """The tensors are those the plan says cross (MessageError if not)."""
        for t, (shape, dtype) in zip(tensors, self.tensors):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise MessageError(f"{self.what}: a tensor of shape {tuple(t.shape)} and dtype {dtype_name(t.dtype)} "
                                   f"where the plan has {shape}, {dtype_name(dtype)}; re-run `planner profile` and "
                                   "`planner solve` for this model")
        if len(tensors) != len(self.tensors):
            raise MessageError(f"{self.what}: {len(tensors)} tensors where the plan has {len(self.tensors)}")

    def pack(self, tensors: Sequence[torch.Tensor], device: torch.device) -> Tuple[torch.Tensor, bool]:
        """The tensor that travels: the one tensor itself (no copy when contiguous), else a byte
        buffer holding all of them; and whether it is a copy (then the tensors' storage may go
        before the send completes)."""
        self.check(tensors)
        if len(tensors) == 1:
            return _wire_of(tensors[0], self.orders[0])
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for t, view in zip(tensors, self.views(flat)):
            view.copy_(t.detach())
        return flat, True

    def empty(self, device: torch.device) -> torch.Tensor:
        """A buffer to receive the message into."""
        if len(self.tensors) == 1:
            shape, dtype = self.tensors[0]
            shape = shape_in_order(shape, self.orders[0])
            if dtype.is_complex:  # the real view it travels as (_wire_of)
                return torch.empty((*shape, 2), dtype=dtype.to_real(), device=device)
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def unpack(self, wire: torch.Tensor) -> List[torch.Tensor]:
        """The message's tensors: views of the buffer that travelled (they share its storage)."""
        if len(self.tensors) == 1:
            return [from_order(torch.view_as_complex(wire) if self.tensors[0][1].is_complex else wire,
                                self.orders[0])]
        return self.views(wire)

    def views(self, flat: torch.Tensor, start: int = 0) -> List[torch.Tensor]:
        """The tensors as views of a byte buffer holding the message from byte `start` on."""
        return [from_order(flat[start + offset:start + offset + _numel(shape) * _itemsize(dtype)].view(dtype)
                            .view(shape_in_order(shape, order)), order)
                for offset, (shape, dtype), order in zip(self.offsets, self.tensors, self.orders)]


class PresenceLayout:
    """A gradient message that says which of its tensors got a gradient: the first one for a stage's
    cut between two ranks. A tensor that reached no loss (used only through a comparison, say) has
    none, and single-process training leaves the weights behind it without one (an optimizer skips
    them: no decay, no moments), where a zero gradient would move them. One byte buffer: a
    16-byte-aligned header of one flag per tensor (1: a gradient), then the message as `layout`
    lays it out (zeros where there is none), so the receiver sizes it from the plan alone. Both ends
    then know the flags (a captured graph is the same for every micro-batch) and the pair's later
    messages are the plain layout."""

    def __init__(self, layout: MessageLayout):
        self.layout = layout
        self.header = -(-len(layout) // _ALIGN) * _ALIGN
        self.nbytes = self.header + layout.nbytes

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def pack(self, tensors: Sequence[torch.Tensor], present: Sequence[bool], device: torch.device) -> torch.Tensor:
        """The byte buffer that travels (always a copy); `tensors` as the layout's pack takes them."""
        self.layout.check(tensors)
        flat = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        flat[:len(present)] = torch.tensor([int(bool(p)) for p in present], dtype=torch.uint8)
        for t, view, p in zip(tensors, self.layout.views(flat, self.header), present):
            if p:
                view.copy_(t.detach())
        return flat

    def unpack(self, wire: torch.Tensor) -> Tuple[List[torch.Tensor], Tuple[bool, ...]]:
        """The tensors (views of the buffer) and which of them are gradients."""
        present = tuple(bool(f) for f in wire[:len(self.layout)].cpu().tolist())
        return self.layout.views(wire, self.header), present


def in_order(tensor: Any, order: Optional[Sequence[int]]) -> Any:
    """`tensor` laid out as a message in `order` delivers it (None: its shape's order), for a value a stage
    hands over in memory: itself where it lies so, else a copy that does (what is not a strided tensor as it is)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return tensor
    permuted = to_order(tensor, order)
    return tensor if permuted.is_contiguous() else from_order(permuted.contiguous(), order)


def _wire_of(tensor: torch.Tensor, order: Optional[Tuple[int, ...]] = None) -> Tuple[torch.Tensor, bool]:
    """The one tensor of a message as it travels, contiguous in `order` (its dimensions in memory
    order, None: its shape's), a complex one as its real view (gloo and NCCL move floating and
    integer tensors); and whether that is a copy (a tensor not dense in that order, or a lazily
    conjugated one, which `view_as_real` cannot view, is)."""
    tensor = to_order(tensor.detach(), order)
    copied = not tensor.is_contiguous() or tensor.is_conj()
    wire = tensor.resolve_conj().contiguous()
    return (torch.view_as_real(wire) if wire.is_complex() else wire), copied


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # not from a tensor: making a complex32 one warns that it is experimental


@dataclass
class Operation:
    """One point-to-point operation of a batch: send `tensor` to `peer`, or receive into it."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int


def post(operations: Sequence[Operation], use_tags: bool, local=None) -> List[object]:
    """Post every operation together; their works, to wait for. The operations with a peer that `local`
    (runtime.shared_memory.SharedMemoryTransport) reaches go through it, the others through
    torch.distributed (batch_isend_irecv)."""
    if local is not None:
        near = [op for op in operations if local.handles(op.peer)]
        far = [op for op in operations if not local.handles(op.peer)]
        return local.post(near) + post(far, use_tags)
    if not operations:
        return []
    ops = [dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.peer, tag=op.tag if use_tags else 0)
           for op in operations]
    return list(dist.batch_isend_irecv(ops))


def exchange(operations: Sequence[Operation], use_tags: bool, local=None) -> None:
    """Post every operation together and wait for all of them."""
    for work in post(operations, use_tags, local):
        work.wait()


_CODES = list(_DTYPES.values())


class DescribedLayout:
    """A message that says its own tensors' dtypes: the first one between two ranks under
    autocast, whose activations' dtypes the plan (profiled without it) cannot know. One byte
    buffer: a 16-byte-aligned header of one dtype code per tensor, then each tensor at the offset
    its widest dtype (the plan's, or 8 bytes per element where that is narrower: complex128 is 16) would take, so
    the receiver can size the buffer from the plan alone. Both ends then know the dtypes, and
    the pair's later messages use the exact `MessageLayout`."""

    def __init__(self, planned: MessageLayout):
        self.planned = planned
        self.shapes = [shape for shape, _ in planned.tensors]
        header = -(-len(self.shapes) // _ALIGN) * _ALIGN
        self.offsets: List[int] = []
        total = header
        for shape, dtype in planned.tensors:
            total = -(-total // _ALIGN) * _ALIGN
            self.offsets.append(total)
            total += _numel(shape) * max(8, _itemsize(dtype))
        self.nbytes = total

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def pack(self, tensors: Sequence[torch.Tensor], device: torch.device) -> Tuple[torch.Tensor, bool]:
        """The byte buffer that travels, and True: it is always a copy (MessageLayout.pack)."""
        for t, shape in zip(tensors, self.shapes):
            if tuple(t.shape) != shape or t.dtype not in _CODES:
                raise MessageError(f"{self.planned.what}: a tensor of shape {tuple(t.shape)} and dtype "
                                   f"{dtype_name(t.dtype)} where the plan has {shape}; re-run `planner profile` and "
                                   "`planner solve` for this model")
        flat = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        flat[:len(tensors)] = torch.tensor([_CODES.index(t.dtype) for t in tensors], dtype=torch.uint8)
        for t, offset in zip(tensors, self.offsets):
            size = t.numel() * t.element_size()
            flat[offset:offset + size].view(t.dtype).view(t.shape).copy_(t.detach())
        return flat, True

    def unpack(self, wire: torch.Tensor) -> Tuple[List[torch.Tensor], MessageLayout]:
        """The tensors (views of the buffer) and the exact layout of the pair's later messages."""
        codes = wire[:len(self.shapes)].cpu().tolist()
        dtypes = [_CODES[c] for c in codes]
        tensors = [wire[offset:offset + _numel(shape) * _itemsize(dtype)].view(dtype).view(shape)
                   for offset, shape, dtype in zip(self.offsets, self.shapes, dtypes)]
        return tensors, MessageLayout(list(zip(self.shapes, dtypes)), self.planned.what, self.planned.orders)
