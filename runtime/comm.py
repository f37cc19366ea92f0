"""Point-to-point transport between neighbouring stages on torch.distributed.

Sends are non-blocking (the engine waits for them before the optimizer step, and keeps the
tensors alive until then). Receives can be posted ahead of the action that needs them
(`post_recv`, then `recv(..., posted=)`): gloo's TCP transport is a rendezvous protocol, a
send's payload leaves only once the receiver has posted the matching receive, so a receive
posted at the moment its data is needed pays a round trip of two background-thread wake-ups on
the critical path (BENCHMARKS.md: what it costs on a loaded host). Each message carries a tag derived from
the micro-batch, the direction and the tensor's position, so messages cannot be mismatched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

_DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}

ACTIVATION, GRADIENT = 0, 1


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"tensor dtype {name!r} cannot be sent between stages") from None


def message_tag(micro_batch: int, direction: int, position: int) -> int:
    return (micro_batch * 2 + direction) * 1024 + position


@dataclass
class PostedRecv:
    """Receives posted for one action: the buffers they fill and their pending works."""

    buffers: List[torch.Tensor]
    works: List[dist.Work]


class PointToPoint:
    def __init__(self, device: torch.device, use_tags: bool = True):
        self.device = device
        self.use_tags = use_tags  # NCCL ignores tags; gloo matches on them
        self.pending: List[dist.Work] = []
        self._keep_alive: List[torch.Tensor] = []

    def send(self, tensors: Sequence[torch.Tensor], dst: int, micro_batch: int, direction: int) -> None:
        for position, tensor in enumerate(tensors):
            tensor = tensor.detach().contiguous()
            tag = message_tag(micro_batch, direction, position) if self.use_tags else 0
            self.pending.append(dist.isend(tensor, dst, tag=tag))
            self._keep_alive.append(tensor)

    def post_recv(self, specs: Sequence[dict], src: int, micro_batch: int, direction: int) -> PostedRecv:
        """Post one receive per spec ({'shape', 'dtype'}) from `src`; returns at once."""
        posted = PostedRecv([], [])
        for position, spec in enumerate(specs):
            buffer = torch.empty(spec["shape"], dtype=torch_dtype(spec["dtype"]), device=self.device)
            tag = message_tag(micro_batch, direction, position) if self.use_tags else 0
            posted.works.append(dist.irecv(buffer, src, tag=tag))
            posted.buffers.append(buffer)
        return posted

    def recv(self, specs: Sequence[dict], src: int, micro_batch: int, direction: int,
             posted: Optional[PostedRecv] = None) -> List[torch.Tensor]:
        """The tensors of one message, blocking until all arrive (posting the receives first unless
        `posted` holds them from an earlier `post_recv` with the same arguments)."""
        if posted is None:
            posted = self.post_recv(specs, src, micro_batch, direction)
        for work in posted.works:
            work.wait()
        return posted.buffers

    def wait_sends(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
        self._keep_alive.clear()
