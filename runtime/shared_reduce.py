"""The data-parallel gradient all-reduce between the CPU ranks of one host, through shared memory.

Why: a gloo collective waits as its point-to-point messages did (runtime/shared_memory.py): asleep
in the kernel, woken late on a busy host. A small model's 0.26 MiB gradient all-reduce took
1.5-1.75 ms through gloo where copying its bytes takes tens of microseconds (BENCHMARKS.md,
"Shared-memory all-reduce").

Each member of a group has a file in /dev/shm, mapped by every member: two counters (chunks it has
published, chunks it has reduced), each in its own cache line, two input slots and two result slots
of a chunk. A tensor is reduced in chunks of a slot; for chunk s (counted over the run), with
d members, each member k

1. copies its chunk into its input slot s mod 2 and publishes s + 1,
2. waits until every member has published s + 1,
3. sums segment k of the chunk (its k-th d-th) over the members' input slots **in rank order** into
   its result slot s mod 2, and says it has reduced s + 1,
4. waits until every member has reduced s + 1 and copies every member's segment into its tensor.

Each element is summed once, by one member, in rank order, so every replica gets the same bits (as
gloo's ring, which sums each piece once); each member reads and writes about three chunks' bytes
whatever d is. With two members each sums the whole chunk (x0 + x1, the same bits on both) and steps
3-4 are one. A slot is free again two chunks later: a member publishes chunk s + 2 only after it
finished chunk s + 1, whose waits saw every member publish (two members) or reduce chunk s + 1,
hence finish reading chunk s. A group uses shared memory only where every member shares this host's /dev/shm and it has
room (`reducer`: every member decides alike). The waits are the transport's
(SharedMemoryTransport.wait_until): they move the rank's posted messages on, notice a member whose
process is gone, and time out. Ordering: as the rings, on x86.
"""
from __future__ import annotations

import ctypes
import os
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from runtime.shared_memory import SharedMemoryTransport
from runtime.shm_files import SharedMemoryFull, map_file, room_for, shm_path

SLOT_BYTES = 1 << 20  # a chunk at most: four slots per member bound what a group takes in /dev/shm
PUBLISHED, REDUCED = 0, 64  # the counters' offsets, each in its own cache line
HEADER_BYTES = 4096  # the counters, padded to a page: the slots stay aligned for every dtype


def slot_size(largest_bytes: int) -> int:
    """A slot for tensors of at most `largest_bytes`: SLOT_BYTES at most, in whole pages."""
    return max(4096, -(-min(largest_bytes, SLOT_BYTES) // 4096) * 4096)


def group_bytes(members: int, largest_bytes: int) -> int:
    """What a group of `members` takes in /dev/shm for tensors of at most `largest_bytes`."""
    return members * (HEADER_BYTES + 4 * slot_size(largest_bytes))


class _Member:
    """One member's file as a rank maps it: its counters, its input slots and its result slots."""

    def __init__(self, path: str, slot_bytes: int, create: bool):
        self._map = map_file(path, HEADER_BYTES + 4 * slot_bytes if create else None, "gradient all-reduce area")
        self.published = ctypes.c_int64.from_buffer(self._map, PUBLISHED)
        self.reduced = ctypes.c_int64.from_buffer(self._map, REDUCED)
        areas = [torch.frombuffer(self._map, dtype=torch.uint8, count=slot_bytes,
                                  offset=HEADER_BYTES + k * slot_bytes) for k in range(4)]
        self.inputs, self.results = areas[:2], areas[2:]

    def close(self) -> None:
        del self.published, self.reduced, self.inputs, self.results  # the views of the mapping first
        self._map.close()


class SharedMemoryReducer:
    """The sum of a tensor over the members of a group on one host, left in every member's tensor."""

    def __init__(self, transport: SharedMemoryTransport, members: Sequence[int], slot_bytes: int,
                 files: Dict[int, _Member]):
        self.transport, self.members, self.slot_bytes = transport, sorted(members), slot_bytes
        self.rank = transport.rank
        self._files = [files[m] for m in self.members]  # rank order
        self._index = self.members.index(self.rank)
        self._mine = files[self.rank]
        self.sequence = 0  # chunks reduced so far: the same on every member
        self.reductions = 0  # tensors reduced (the run's report)

    def all_reduce(self, tensor: torch.Tensor, counted: bool = True) -> None:
        """Sum `tensor` (contiguous, on the CPU) over the members, in place; `reductions` counts the
        gradient buckets' (`counted`), not the step's loss."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("a shared-memory all-reduce needs one contiguous CPU tensor")
        flat = tensor.view(-1)
        per_chunk = self.slot_bytes // tensor.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start:start + per_chunk])
        self.reductions += counted

    def _reduce_chunk(self, chunk: torch.Tensor) -> None:
        s, slot, d = self.sequence, self.sequence % 2, len(self.members)
        n, size = chunk.numel(), chunk.element_size()
        ctypes.memmove(self._mine.inputs[slot].data_ptr(), chunk.data_ptr(), n * size)
        self._mine.published.value = s + 1  # after the bytes (runtime/shm_files.py's note on ordering)
        self._wait(lambda f: f.published.value > s, "for its gradients")
        if d == 2:  # both sum the whole chunk, x0 + x1: the same bits, one phase less
            torch.add(*[f.inputs[slot][:n * size].view(chunk.dtype) for f in self._files], out=chunk)
        else:
            self._reduce_scatter_gather(chunk, s, slot)
        self.sequence += 1

    def _reduce_scatter_gather(self, chunk: torch.Tensor, s: int, slot: int) -> None:
        """Three members or more: this member sums its segment in rank order, then takes everyone's."""
        d, n, size = len(self.members), chunk.numel(), chunk.element_size()
        bounds = [k * n // d * size for k in range(d + 1)]  # member k's segment: bytes bounds[k] to bounds[k + 1]
        a, b = bounds[self._index], bounds[self._index + 1]
        if b > a:
            parts = [f.inputs[slot][a:b].view(chunk.dtype) for f in self._files]
            mine = self._mine.results[slot][a:b].view(chunk.dtype)
            torch.add(parts[0], parts[1], out=mine)
            for part in parts[2:]:
                mine.add_(part)
        self._mine.reduced.value = s + 1
        self._wait(lambda f: f.reduced.value > s, "for its part of the sum")
        for k, f in enumerate(self._files):
            a, b = bounds[k], bounds[k + 1]
            if b > a:
                ctypes.memmove(chunk.data_ptr() + a, f.results[slot].data_ptr() + a, b - a)

    def _wait(self, ready, what: str) -> None:
        def laggard() -> int:  # the first member not ready yet; this rank's own once all are
            return next((m for m, f in zip(self.members, self._files) if not ready(f)), self.rank)

        self.transport.wait_until(lambda: all(ready(f) for f in self._files), laggard,
                                  f"{what} in the gradient all-reduce")

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


def reducer(transport: Optional[SharedMemoryTransport], members: Sequence[int], group, largest_bytes: int,
            kind: str = "reduce") -> Optional[SharedMemoryReducer]:
    """A reducer for the group `group` of global ranks `members` (this rank one of them), sized for
    tensors up to `largest_bytes`; a collective over `group` (every member calls it). None, for every
    member, where some member has no transport to all the others (another host, or none: `transport`
    None) or its /dev/shm lacks room for the group's files. `kind` names the group's files apart from
    another kind's whose first rank is the same (the data-parallel groups', "reduce"; a tie's)."""
    members = sorted(members)
    rank = dist.get_rank()
    slot = slot_size(largest_bytes)
    usable = transport is not None and all(m == rank or transport.handles(m) for m in members) \
        and room_for(group_bytes(len(members), largest_bytes))
    mine = None
    if usable:
        try:
            mine = _Member(_name(transport, members, rank, kind), slot, create=True)
        except (SharedMemoryFull, OSError):
            mine = None
    made = torch.tensor([int(mine is not None)], dtype=torch.int64)
    dist.all_reduce(made, op=dist.ReduceOp.MIN, group=group)  # every member has made its file, or
    if not int(made):                                          # some could not: all agree
        if mine is not None:
            mine.close()
            os.unlink(_name(transport, members, rank, kind))
        return None
    files = {rank: mine}
    try:
        for m in members:
            if m != rank:
                files[m] = _Member(_name(transport, members, m, kind), slot, create=False)
    finally:
        dist.barrier(group=group)  # every member has mapped every file: nothing need stay in /dev/shm
        os.unlink(_name(transport, members, rank, kind))
    return SharedMemoryReducer(transport, members, slot, files)


def _name(transport: SharedMemoryTransport, members: List[int], rank: int, kind: str = "reduce") -> str:
    # a group by its kind and first rank (the groups of one kind are disjoint): short for any group's size
    return shm_path(transport.token, f"{kind}-{members[0]}-{rank}")
