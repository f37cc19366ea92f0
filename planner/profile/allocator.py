"""Keep freed memory in the process instead of handing it back to the system.

glibc returns large freed blocks (every micro-batch's logits, say) to the kernel and page-faults
them back in on the next micro-batch: tens of thousands of faults per step. Raising the mmap and
trim thresholds keeps them in the heap. Profiling and every rank apply the same setting, so the
profile measures what the runs do. A no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False


def retain_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Apply once per process; True if glibc accepted both settings."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    return _applied
