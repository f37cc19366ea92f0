"""The data-parallel gradient all-reduce between the CPU ranks of one host, through shared memory.

Why: a gloo collective waits as its point-to-point messages did (runtime/shared_memory.py): asleep
in the kernel, woken late on a busy host. A small model's gradient all-reduce took 1.5-1.75 ms
through gloo where copying its bytes takes tens of microseconds (BENCHMARKS.md, "Shared-memory
all-reduce").

Each member of a group has a file in /dev/shm, mapped by every member: two counters (chunks it has
published, chunks it has summed), each in its own cache line, and two slots of SLOT_BYTES. A
tensor is reduced in chunks of a slot; for chunk s (counted over the run) every member

1. waits until every member has summed chunk s - 2 (its slot, s mod 2, is free again),
2. copies its chunk into its slot s mod 2 and publishes s + 1,
3. waits until every member has published s + 1,
4. sums the members' slots **in rank order** into its tensor, and says it has summed s + 1.

Every member adds the same numbers in the same order, so the replicas' gradients stay bitwise
equal (as gloo's ring, which sums each piece once, keeps them). Two slots let a member copy in
its next chunk while a slower one still reads the last. A group uses shared memory only where
every member shares this host's /dev/shm and it has room: each member decides alike (`reducer`).
The waits are the transport's (SharedMemoryTransport.wait_until): they move the rank's posted
messages on, notice a member whose process is gone, and time out. Ordering: as the rings, on x86.
"""
from __future__ import annotations

import ctypes
import os
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from runtime.shared_memory import HEADER_BYTES, SharedMemoryFull, SharedMemoryTransport, _path, map_file, room_for

SLOT_BYTES = 1 << 20  # a chunk: two slots per member bound what a group takes in /dev/shm
PUBLISHED, SUMMED = 0, 64  # the counters' offsets, each in its own cache line


def slot_size(largest_bytes: int) -> int:
    """A slot for tensors of at most `largest_bytes`: SLOT_BYTES at most, in whole pages."""
    return max(4096, -(-min(largest_bytes, SLOT_BYTES) // 4096) * 4096)


class _Member:
    """One member's file as this rank maps it: its two counters and its two slots as byte tensors."""

    def __init__(self, path: str, slot_bytes: int, create: bool):
        self._map = map_file(path, HEADER_BYTES + 2 * slot_bytes if create else None, "gradient all-reduce area")
        self.published = ctypes.c_int64.from_buffer(self._map, PUBLISHED)
        self.summed = ctypes.c_int64.from_buffer(self._map, SUMMED)
        self.slots = [torch.frombuffer(self._map, dtype=torch.uint8, count=slot_bytes,
                                       offset=HEADER_BYTES + k * slot_bytes) for k in range(2)]

    def close(self) -> None:
        del self.published, self.summed, self.slots  # the views of the mapping go first
        self._map.close()


class SharedMemoryReducer:
    """The sum of a tensor over the members of a group on one host, left in every member's tensor."""

    def __init__(self, transport: SharedMemoryTransport, members: Sequence[int], slot_bytes: int,
                 mine: _Member, others: dict):
        self.transport, self.members, self.slot_bytes = transport, list(members), slot_bytes
        self.rank = transport.rank
        self._files = [mine if m == self.rank else others[m] for m in self.members]  # rank order
        self._mine = mine
        self.sequence = 0  # chunks reduced so far: the same on every member
        self.reductions = 0  # tensors reduced (the run's report)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` (contiguous, on the CPU) over the members, in place, in rank order."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("a shared-memory all-reduce needs one contiguous CPU tensor")
        flat = tensor.view(-1)
        per_chunk = self.slot_bytes // tensor.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start:start + per_chunk])
        self.reductions += 1

    def _reduce_chunk(self, chunk: torch.Tensor) -> None:
        s, slot = self.sequence, self.sequence % 2
        nbytes = chunk.numel() * chunk.element_size()
        self._wait(lambda f: f.summed.value >= s - 1, "to free its slot")  # chunk s - 2 is summed everywhere
        ctypes.memmove(self._mine.slots[slot].data_ptr(), chunk.data_ptr(), nbytes)
        self._mine.published.value = s + 1  # after the bytes (runtime/shared_memory.py's note on ordering)
        self._wait(lambda f: f.published.value >= s + 1, "for its gradients")
        parts = [f.slots[slot][:nbytes].view(chunk.dtype) for f in self._files]
        torch.add(parts[0], parts[1], out=chunk)
        for part in parts[2:]:
            chunk.add_(part)
        self._mine.summed.value = s + 1
        self.sequence += 1

    def _wait(self, ready, what: str) -> None:
        def laggard() -> int:
            return next((m for m, f in zip(self.members, self._files) if not ready(f)), self.rank)

        self.transport.wait_until(lambda: all(ready(f) for f in self._files), laggard,
                                  f"{what} in the gradient all-reduce")

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


def reducer(transport: Optional[SharedMemoryTransport], members: Sequence[int], group, largest_bytes: int
            ) -> Optional[SharedMemoryReducer]:
    """A reducer for the group `group` of global ranks `members` (this rank one of them), sized for
    tensors up to `largest_bytes`; a collective over `group` (every member calls it). None, for every
    member, where some member has no transport to all the others (another host, or none: `transport`
    None) or its /dev/shm lacks room for the group's files."""
    members = sorted(members)
    rank = dist.get_rank()
    slot = slot_size(largest_bytes)
    usable = transport is not None and all(m == rank or transport.handles(m) for m in members) \
        and room_for(len(members) * (HEADER_BYTES + 2 * slot))
    mine = None
    if usable:
        try:
            mine = _Member(_name(transport, members, rank), slot, create=True)
        except SharedMemoryFull:
            mine = None
    made = torch.tensor([int(mine is not None)], dtype=torch.int64)
    dist.all_reduce(made, op=dist.ReduceOp.MIN, group=group)  # every member has made its file, or
    if not int(made):                                          # some could not: all agree
        if mine is not None:
            mine.close()
            os.unlink(_name(transport, members, rank))
        return None
    try:
        others = {m: _Member(_name(transport, members, m), slot, create=False) for m in members if m != rank}
    finally:
        dist.barrier(group=group)  # every member has mapped every file: nothing need stay in /dev/shm
        os.unlink(_name(transport, members, rank))
    return SharedMemoryReducer(transport, members, slot, mine, others)


def _name(transport: SharedMemoryTransport, members: List[int], rank: int) -> str:
    return _path(transport.token, f"reduce-{'.'.join(map(str, members))}-{rank}")
