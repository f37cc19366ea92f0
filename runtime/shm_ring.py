"""One direction of a pair of ranks' shared-memory messages (runtime.shared_memory): a file in
/dev/shm (runtime.shm_files), mapped by both, with two byte counters (written by the sender, read by
the receiver, in separate cache lines) and a data area the bytes stream through, wrapping around.
"""
from __future__ import annotations

import ctypes

from runtime.shm_files import map_file

HEADER_BYTES = 128  # the two counters, each in its own 64-byte cache line


class Ring:
    """One direction between two ranks: the mapping, its two counters and its data area, moved with
    ctypes (a message costs a few memmoves and counter reads, not tensor operations)."""

    def __init__(self, path: str, size: int, create: bool):
        self._map = map_file(path, HEADER_BYTES + size if create else None, "message ring")
        size = len(self._map) - HEADER_BYTES
        self._anchor = ctypes.c_char.from_buffer(self._map)  # exports the mapping: released by close
        self._written = ctypes.c_int64.from_buffer(self._map, 0)  # bytes the sender has published
        self._read = ctypes.c_int64.from_buffer(self._map, 64)  # bytes the receiver has released
        self.closed = False
        self._data = ctypes.addressof(self._anchor) + HEADER_BYTES
        self.size = size

    @property
    def written(self) -> int:
        return self._written.value

    @property
    def read(self) -> int:
        return self._read.value

    def put(self, address: int, length: int) -> int:
        """Copy up to `length` bytes from `address` in, as room allows; publish them; how many."""
        written = self._written.value
        count = min(length, self.size - (written - self._read.value))
        if count > 0:
            self._copy(written, address, count, into_ring=True)
            self._written.value = written + count  # after the bytes (runtime.shm_files' note on ordering)
        return count

    def take(self, address: int, length: int) -> int:
        """Copy up to `length` published bytes out to `address`; release them; how many."""
        read = self._read.value
        count = min(length, self._written.value - read)
        if count > 0:
            self._copy(read, address, count, into_ring=False)
            self._read.value = read + count
        return count

    def _copy(self, position: int, address: int, count: int, into_ring: bool) -> None:
        offset = position % self.size
        first = min(count, self.size - offset)  # the rest wraps around to the start
        for ring, outside, n in ((self._data + offset, address, first), (self._data, address + first, count - first)):
            if n > 0:
                if into_ring:
                    ctypes.memmove(ring, outside, n)
                else:
                    ctypes.memmove(outside, ring, n)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        del self._anchor, self._written, self._read
        self._map.close()
