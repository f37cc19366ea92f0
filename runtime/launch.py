"""Start one worker process per stage on this machine and watch them.

If any rank exits with an error, the others are terminated at once (they would otherwise
wait in a receive until the process-group timeout), and the failing rank's one-line error is
returned. Nothing is left running: on Ctrl-C or any exception the children are killed too.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

# How long a rank may wait on another (the process-group timeout) before it fails: the one default of
# `runtime execute --timeout` and of `python -m runtime.worker --timeout` (torchrun launches).
RANK_TIMEOUT_S = 60.0


@dataclass
class LaunchResult:
    ok: bool
    failed_rank: Optional[int] = None
    error: str = ""
    log_path: str = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: List[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def launch_local(world_size: int, worker_args: List[str], out_dir: str, threads: int,
                 timeout_s: float, progress_rank: Optional[int] = None) -> LaunchResult:
    """Run `python -m runtime.worker *worker_args` as ranks 0..world_size-1 and wait for all."""
    port = free_port()
    procs: List[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
            log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
            logs.append(log)
            args = [sys.executable, "-m", "runtime.worker", *worker_args, "--timeout", str(timeout_s)]
            if rank == progress_rank:
                args.append("--progress")
            procs.append(subprocess.Popen(args, env=env, stdout=None if rank == progress_rank else log,
                                          stderr=log, stdin=subprocess.DEVNULL))
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # The first rank that wrote an error file is the cause; the others died of its absence.
                rank = _first_cause(out_dir, failed)
                _stop(procs)
                return LaunchResult(False, rank, _read_error(out_dir, rank, codes[rank]),
                                    os.path.join(out_dir, f"rank{rank}.log"))
            if all(c == 0 for c in codes):
                return LaunchResult(True)
            time.sleep(0.05)
    except BaseException:
        _stop(procs, grace_s=1.0)
        raise
    finally:
        for log in logs:
            log.close()


def _first_cause(out_dir: str, failed: List[int]) -> int:
    stamped = []
    for rank in failed:
        path = os.path.join(out_dir, f"rank{rank}.error")
        if os.path.exists(path):
            stamped.append((os.path.getmtime(path), rank))
    return min(stamped)[1] if stamped else failed[0]


def _read_error(out_dir: str, rank: int, code: Optional[int]) -> str:
    path = os.path.join(out_dir, f"rank{rank}.error")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code} before reporting an error"
