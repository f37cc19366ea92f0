"""Point-to-point messages between the CPU ranks of one host, through shared memory.

Why: gloo's point-to-point wait sleeps in the kernel, and on a busy host a rank woken by a
message pays for it: two processes exchanging 2 KiB after 2 ms of compute each waited 2 ms at the
median (20 us back to back), which is what small micro-batches meet on every message
(BENCHMARKS.md, "Shared-memory messages"). Here the receiver polls a counter in memory the sender
writes, so a message costs a copy in and a copy out.

Each ordered pair of ranks (sender, receiver) has a ring (runtime.shm_ring: a file in /dev/shm,
mapped by both, with two byte counters and a data area; the files: runtime.shm_files). A message is
a 16-byte record header (tag, byte count) followed by its bytes, streamed through the ring: a
message larger than the free space goes in pieces as the receiver takes them.
The sender creates its ring at its first send to that peer (sized for four such messages, 1 MiB at
least: a send completes once its bytes are in, which NCCL's rules never count on; its pages are
allocated at once, so a full /dev/shm is a one-line error, not a SIGBUS) and the receiver opens it at
its first receive. `connect` uses rings only where every rank's /dev/shm has room for the plan's.

The rules are NCCL's (runtime.comm): the operations between two ranks complete in the order they
were posted, so each ring is first-in first-out, and a receive checks that the record is the one it
expects (tag and size) instead of searching. Waiting for any operation moves every posted one on,
so two ranks whose sends both wait for ring space each take the other's bytes meanwhile.

A wait polls and yields the processor (os.sched_yield: a rank sharing a core with its peer lets it
run), sleeps 50 us between polls once it has waited 20 ms (a peer's long compute), stops within
0.1 s of then once the peer's process is gone (each rank holds a lock on its liveness file, which
the kernel releases however the process ends: error, exit or signal), and fails after the run's
timeout. Rings need x86 (runtime.shm_files' note on ordering).

Which peers: every rank creates a probe file named by the run's token (`runtime execute`'s launcher
draws it and removes what is left of the run's files at its end; under torchrun rank 0 draws it) and
locks it (its liveness file); the ranks whose probes it can see share its /dev/shm (one host, one
container), and only those use rings.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import time
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Set

import torch

from runtime.comm import MessageError, Operation
from runtime import shm_files
from runtime.shm_files import RUN_TOKEN, room_for, shm_path
from runtime.shm_ring import Ring

MIN_RING_BYTES = 1 << 20
# Messages a ring holds: a send that finds no room moves only when its rank next posts or waits
# (nothing moves bytes in the background), so a receiver could wait through the sender's compute.
RING_RECORDS = 4
RECORD_BYTES = 16  # tag, byte count
SWITCH = -1  # a record's tag: the sender goes on in a new ring of the record's byte count
ALIVE_EVERY_S = 0.1  # how often a waiting rank checks that its peer's process is still there
SPIN_S = 0.02  # poll without sleeping this long, then sleep between polls
SLEEP_S = 50e-6


def available() -> bool:
    """Whether this machine can use rings: x86 (runtime.shm_files' note on ordering) with a writable
    /dev/shm."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.access(shm_files.SHM_DIR, os.W_OK)


def ring_size(message_bytes: int) -> int:
    """The data bytes of a ring made for messages of `message_bytes`: RING_RECORDS of their records,
    MIN_RING_BYTES at least, in whole pages (also the bound the callers of `connect` count per ring)."""
    size = max(MIN_RING_BYTES, RING_RECORDS * (RECORD_BYTES + message_bytes))
    return -(-size // 4096) * 4096


class _Pending:
    """A posted operation: the bytes still to move (the record header, then the tensor's)."""

    def __init__(self, operation: Operation):
        tensor = operation.tensor
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("a shared-memory message must be one contiguous CPU tensor")
        self.operation = operation
        self.nbytes = tensor.numel() * tensor.element_size()
        self.header = (ctypes.c_int64 * 2)(operation.tag, self.nbytes)
        self.moved = 0  # of header + payload
        self.done = False
        self.switched = False  # a receive that read a SWITCH record: the sender goes on in a new ring

    @property
    def record_bytes(self) -> int:
        return RECORD_BYTES + self.nbytes

    def advance(self, ring: Ring, peer: int) -> bool:
        """Move what the ring allows; whether anything moved. A receive that read a SWITCH record
        returns with `switched` set and its header to be read again (from the new ring)."""
        move = ring.put if self.operation.send else ring.take
        moved = False
        while not self.done:
            if self.moved < RECORD_BYTES:
                n = move(ctypes.addressof(self.header) + self.moved, RECORD_BYTES - self.moved)
                if not self.operation.send and self.moved + n == RECORD_BYTES:
                    if self.header[0] == SWITCH:
                        self.switched, self.moved = True, 0
                        return True
                    self._check(peer)
            else:
                part = self.moved - RECORD_BYTES
                n = move(self.operation.tensor.data_ptr() + part, self.nbytes - part)
            if n == 0:
                return moved
            moved, self.moved = True, self.moved + n
            self.done = self.moved == self.record_bytes
        return moved

    def _check(self, peer: int) -> None:
        tag, size = self.header
        if tag < 0 or (tag, size) != (self.operation.tag, self.nbytes):
            raise MessageError(f"rank {peer} sent a message of {size} bytes (tag {tag}) where this rank expected "
                               f"{self.nbytes} bytes (tag {self.operation.tag}): the ranks run different lists")


class SharedMemoryWork:
    """What post returns per operation, like torch.distributed's Work: wait() and is_completed()."""

    def __init__(self, transport: "SharedMemoryTransport", pending: _Pending):
        self._transport, self._pending = transport, pending

    def is_completed(self) -> bool:
        self._transport.progress()
        return self._pending.done

    def wait(self) -> bool:
        self._transport.wait_for(self._pending)
        return True


class SharedMemoryTransport:
    """The rings of this rank with the peers that share its /dev/shm."""

    def __init__(self, token: str, rank: int, peers: Set[int], timeout_s: float,
                 alive: Optional[Dict[int, int]] = None):
        self.token, self.rank, self.peers, self.timeout_s = token, rank, set(peers), timeout_s
        self._alive = dict(alive or {})  # rank -> a descriptor of its liveness file (connect); ours is locked
        self._checked = 0.0
        self._rings: Dict[tuple, Ring] = {}  # (sender, receiver)
        self._generation: Dict[tuple, int] = {}  # how many times the pair's ring was replaced by a larger one
        self._queues: Dict[tuple, List[_Pending]] = {}
        self._created: List[str] = []
        self.messages = 0  # operations completed through the rings (the run's report)

    def handles(self, peer: int) -> bool:
        return peer in self.peers

    def post(self, operations: Sequence[Operation]) -> List[SharedMemoryWork]:
        works = []
        for operation in operations:
            pending = _Pending(operation)
            key = (self.rank, operation.peer) if operation.send else (operation.peer, self.rank)
            self._queues.setdefault(key, []).append(pending)
            works.append(SharedMemoryWork(self, pending))
        self.progress()
        return works

    def progress(self) -> bool:
        """Move every channel's operations on, oldest first; whether anything moved."""
        moved = False
        for key, queue in self._queues.items():
            while queue:
                first = queue[0]
                ring = self._ring(key, first)
                if ring is None:
                    break
                if first.operation.send and first.moved == 0 and first.record_bytes > ring.size:
                    ring = self._grow(key, ring, first)  # a message larger than the whole ring
                    if ring is None:
                        break
                moved |= first.advance(ring, key[0] if key[1] == self.rank else key[1])
                if first.switched:
                    self._rings.pop(key).close()
                    self._generation[key] = self._generation.get(key, 0) + 1
                    first.switched = False
                    continue  # the receive goes on in the new ring (opened by _ring)
                if not first.done:
                    break
                queue.pop(0)
                self.messages += 1
        return moved

    def _grow(self, key: tuple, ring: Ring, first: _Pending) -> Optional[Ring]:
        """Replace the ring by one of RING_RECORDS times `first`'s record: create it, then tell the
        receiver in the old one (a SWITCH record, once there is room for it). None while there is none."""
        if ring.size - (ring.written - ring.read) < RECORD_BYTES:
            return None
        generation = self._generation.get(key, 0) + 1
        bigger = self._create(key, generation, first)
        switch = (ctypes.c_int64 * 2)(SWITCH, bigger.size)
        ring.put(ctypes.addressof(switch), RECORD_BYTES)
        ring.close()
        self._rings[key], self._generation[key] = bigger, generation
        return bigger

    def _create(self, key: tuple, generation: int, first: _Pending) -> Ring:
        """A new ring of this rank's to the receiver of `key`, sized for `first`'s message."""
        path = self._ring_path(key, generation)
        ring = Ring(path, ring_size(first.nbytes), create=True)
        self._created.append(path)  # removed at close unless the receiver opened (and removed) it
        return ring

    def _ring_path(self, key: tuple, generation: int) -> str:
        return shm_path(self.token, f"{key[0]}-{key[1]}-{generation}")

    def wait_for(self, pending: _Pending) -> None:
        what = "to take a message" if pending.operation.send else "for a message"
        self.wait_until(lambda: pending.done, lambda: pending.operation.peer, what)

    def wait_until(self, ready: Callable[[], bool], peer: Callable[[], int], what: str) -> None:
        """Until `ready()`, moving every posted operation on meanwhile: `peer()` is a rank waited on
        (checked to be alive, named by the timeout's error; this rank's own: none is waited on now)."""
        start = time.perf_counter()  # since anything last moved
        while not ready():
            if self.progress():
                start = time.perf_counter()
                continue
            waited = time.perf_counter() - start
            if waited >= SPIN_S:
                awaited = peer()  # once: it may have become ready since ready() was asked
                self._check_alive(awaited)
                if waited > self.timeout_s:
                    raise TimeoutError(f"rank {self.rank} waited {waited:.1f} s for rank {awaited} ({what}): rank "
                                       f"{awaited} is stuck or gone; raise --timeout if its work takes longer")
                time.sleep(SLEEP_S)
            else:
                os.sched_yield()

    def _check_alive(self, peer: int) -> None:
        """Stop waiting on a rank whose process is gone (it exited, failed or was killed): its lock on
        its liveness file is released then, which a shared lock taken here finds. At most every 0.1 s."""
        now = time.perf_counter()
        if peer == self.rank or peer not in self._alive or now - self._checked < ALIVE_EVERY_S:
            return  # (a shared lock on our own file would convert our lock, then lose it)
        self._checked = now
        try:
            fcntl.flock(self._alive[peer], fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # still held: the peer's process is there
        fcntl.flock(self._alive[peer], fcntl.LOCK_UN)
        raise RuntimeError(f"rank {peer} is gone (it exited, failed or was killed) while rank {self.rank} "
                           "waited on it")

    def _ring(self, key: tuple, first: _Pending) -> Optional[Ring]:
        ring = self._rings.get(key)
        if ring is not None:
            return ring
        generation = self._generation.get(key, 0)
        if key[0] == self.rank:
            ring = self._create(key, generation, first)
        else:
            path = self._ring_path(key, generation)
            try:
                ring = Ring(path, 0, create=False)
            except FileNotFoundError:  # the sender has not sent yet
                return None
            os.unlink(path)  # both hold it now: nothing is left in /dev/shm if either dies
        self._rings[key] = ring
        return ring

    def close(self) -> None:
        """Unmap the rings, remove what this rank created and nobody opened, and release the liveness
        files (ours last: a peer still waiting on this rank learns it is gone). Safe to call twice."""
        for ring in self._rings.values():
            try:
                ring.close()
            except BufferError:  # a tensor still views it: the mapping goes with the process
                pass
        self._rings.clear()
        for path in self._created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._created.clear()
        for peer in sorted(self._alive, key=lambda r: r == self.rank):
            os.close(self._alive.pop(peer))


def connect(rank: int, world: int, timeout_s: float, ring_bytes: int = 0) -> Optional[SharedMemoryTransport]:
    """The transport to the ranks sharing this rank's /dev/shm; a collective over the default group
    (every rank calls it, with the same `ring_bytes`: what the run's rings may take on one host).
    None, for every rank, where a rank cannot use rings or its /dev/shm lacks that room, and for a
    rank no other shares its /dev/shm with."""
    import torch.distributed as dist

    usable = torch.tensor([1 if available() and room_for(ring_bytes) else 0], dtype=torch.int64)
    dist.all_reduce(usable, op=dist.ReduceOp.MIN)
    if world == 1 or not int(usable):
        return None
    token = [os.environ.get(RUN_TOKEN) or uuid.uuid4().hex[:16] if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    # the probe: this rank's liveness file, locked while the process lives (the kernel releases the
    # lock however it ends); the peers that see it share this /dev/shm and keep a descriptor of it
    probe = shm_path(token[0], f"probe-{rank}")
    alive = {rank: os.open(probe, os.O_CREAT | os.O_RDWR, 0o600)}
    try:
        fcntl.flock(alive[rank], fcntl.LOCK_EX)
        dist.barrier()
        for r in range(world):
            if r != rank:
                try:
                    alive[r] = os.open(shm_path(token[0], f"probe-{r}"), os.O_RDWR)
                except FileNotFoundError:  # on another host (or in another container)
                    pass
        dist.barrier()
    except BaseException:
        for fd in alive.values():
            os.close(fd)
        raise
    finally:
        os.unlink(probe)
    peers = set(alive) - {rank}
    if not peers:
        os.close(alive[rank])
        return None
    return SharedMemoryTransport(token[0], rank, peers, timeout_s, alive)
