"""Point-to-point transport between neighbouring stages on torch.distributed.

Sends are non-blocking (the engine waits for them before the optimizer step, and keeps the
tensors alive until then); receives block. Each message carries a tag derived from the
micro-batch, the direction and the tensor's position, so messages cannot be mismatched.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

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

    def recv(self, specs: Sequence[dict], src: int, micro_batch: int, direction: int) -> List[torch.Tensor]:
        """Receive one tensor per spec ({'shape', 'dtype'}) from `src`, blocking until all arrive."""
        buffers, works = [], []
        for position, spec in enumerate(specs):
            buffer = torch.empty(spec["shape"], dtype=torch_dtype(spec["dtype"]), device=self.device)
            tag = message_tag(micro_batch, direction, position) if self.use_tags else 0
            works.append(dist.irecv(buffer, src, tag=tag))
            buffers.append(buffer)
        for work in works:
            work.wait()
        return buffers

    def wait_sends(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
        self._keep_alive.clear()
