"""Point-to-point messages between ranks, posted in batches.

A *message* is what one communication action moves: the tensors crossing a cut for one
micro-batch (activations forward, the gradients of those that need them back). It travels as ONE
tensor whatever its tensor count (a message pays one operation): its only tensor, or else one
byte buffer holding them all, each at a 16-byte-aligned offset. Both ends derive the layout from
the same plan values (`MessageLayout`), so nothing describing the message travels with it.

A *batch* is the operations a rank posts together: `exchange` posts them all with
`torch.distributed.batch_isend_irecv` and then waits for every one of them, sends and receives,
before it returns. A send's buffer is free once its batch has returned: NCCL completes a send
only with its matching receive, and on gloo the wait covers the send too. Tags (gloo matches on
them; NCCL ignores them and matches a pair's operations in issue order) make every message of a
step distinct.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

_DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
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
    the one tensor that travels."""

    def __init__(self, tensors: Sequence[Tuple[Tuple[int, ...], torch.dtype]], what: str):
        self.tensors = [(tuple(shape), dtype) for shape, dtype in tensors]
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

    def pack(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The tensor that travels: the one tensor itself (no copy when contiguous), else a byte
        buffer holding all of them."""
        for t, (shape, dtype) in zip(tensors, self.tensors):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise MessageError(f"{self.what}: a tensor of shape {tuple(t.shape)} and dtype {dtype_name(t.dtype)} "
                                   f"where the plan has {shape}, {dtype_name(dtype)}; re-run `planner profile` and "
                                   "`planner solve` for this model")
        if len(tensors) != len(self.tensors):
            raise MessageError(f"{self.what}: {len(tensors)} tensors where the plan has {len(self.tensors)}")
        if len(tensors) == 1:
            return tensors[0].detach().contiguous()
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for t, view in zip(tensors, self.unpack(flat)):
            view.copy_(t.detach())
        return flat

    def empty(self, device: torch.device) -> torch.Tensor:
        """A buffer to receive the message into."""
        if len(self.tensors) == 1:
            shape, dtype = self.tensors[0]
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def unpack(self, wire: torch.Tensor) -> List[torch.Tensor]:
        """The message's tensors: views of the buffer that travelled (they share its storage)."""
        if len(self.tensors) == 1:
            return [wire]
        return [wire[offset:offset + _numel(shape) * _itemsize(dtype)].view(dtype).view(shape)
                for offset, (shape, dtype) in zip(self.offsets, self.tensors)]


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Operation:
    """One point-to-point operation of a batch: send `tensor` to `peer`, or receive into it."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int


def exchange(operations: Sequence[Operation], use_tags: bool) -> None:
    """Post every operation together (batch_isend_irecv) and wait for all of them."""
    if not operations:
        return
    ops = [dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.peer, tag=op.tag if use_tags else 0)
           for op in operations]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
