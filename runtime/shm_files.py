"""The run's files in /dev/shm: the message rings of runtime.shared_memory (runtime.shm_ring) and the
gradient all-reduce's areas (runtime.shared_reduce). Each is named by the run's token, appears whole
with its pages allocated (a full /dev/shm is a one-line error, not a SIGBUS), and is mapped by the
ranks of one host; what is left of a run's files is removed at its end.

Ordering: the counters in these files are written after the bytes they publish, which x86's memory
model (stores seen in program order) makes safe without fences; other machines use gloo.
"""
from __future__ import annotations

import mmap
import os
from typing import Optional


class SharedMemoryFull(RuntimeError):
    """/dev/shm could not give a file its pages."""


SHM_DIR = "/dev/shm"
# names the run's files; set by `runtime execute`'s launcher, which removes them at its end
RUN_TOKEN = "PIPEPLANNER_RUN_TOKEN"


def remove_rings(token: str) -> None:
    """Remove every file of the run `token` from /dev/shm (a rank killed before its receiver opened
    its ring leaves that ring behind)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(f"pipeplanner-{token}-"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


def shm_path(token: str, what: str) -> str:
    return os.path.join(SHM_DIR, f"pipeplanner-{token}-{what}")


def map_file(path: str, nbytes: Optional[int], what: str) -> mmap.mmap:
    """Map the file at `path`: a new one of `nbytes` (its pages allocated now: tmpfs files are
    sparse, and a page it cannot give later is a SIGBUS; it appears whole, by a rename, so a
    peer never opens it half made), or with `nbytes` None an existing one, whole."""
    tmp = None
    if nbytes is None:
        fd = os.open(path, os.O_RDWR)
        nbytes = os.fstat(fd).st_size
    else:
        tmp = path + ".new"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if tmp is not None:
            os.posix_fallocate(fd, 0, nbytes)
        mapped = mmap.mmap(fd, nbytes)
    except OSError as e:
        if tmp is None:
            raise
        os.unlink(tmp)
        raise SharedMemoryFull(f"{SHM_DIR} has no room for a {nbytes / 2**20:.1f} MiB {what} ({e.strerror}): "
                               f"run with --p2p gloo or enlarge {SHM_DIR} (e.g. docker --shm-size)") from None
    finally:
        os.close(fd)
    if tmp is not None:
        os.rename(tmp, path)
    return mapped


def room_for(ring_bytes: int) -> bool:
    """Whether /dev/shm has `ring_bytes` free."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= ring_bytes
