"""Start one worker process per stage on this machine and watch them.

If any rank exits with an error, the others are terminated at once (they would otherwise
wait in a receive until the process-group timeout), and the failing rank's one-line error is
returned. Nothing is left running: on Ctrl-C or any exception the children are killed too, and
on Linux a launcher killed outright (SIGKILL) takes its ranks with it (`runtime.worker` asks the
kernel for SIGTERM when its parent ends; `_leave_fork_server`).

Ranks are forked from a fork server that has imported torch and the worker once (multiprocessing's
"forkserver": a clean process, no CUDA or threads started, so forking it is safe), not started as
fresh interpreters that each import torch again: that import is about 2 CPU seconds per rank,
paid once per command instead of once per rank (and once per test session, for the tests'
many runs). Each rank gets its environment, its log file as stdout and stderr (the reporting
rank's stdout goes to a file this process copies to its own stdout as it grows), and runs
`runtime.worker.main`. `PIPEPLANNER_LAUNCH=subprocess` starts `python -m runtime.worker`
processes instead.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, TextIO

from runtime.options import END_WITH_PARENT
from runtime.shm_files import RUN_TOKEN, remove_rings


# What the fork server imports once for all ranks. torch._dynamo: building the first optimizer imports
# it (about 800 modules, sympy among them; 1 CPU second a rank, more than the rank's own set-up).
FORK_SERVER_PRELOAD = ["runtime.worker", "torch._dynamo"]


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


class _Rank:
    """One rank's process, forked from the fork server or started as `python -m runtime.worker`."""

    def __init__(self, argv: List[str], env: Dict[str, str], log_path: str, stdout_path: Optional[str]):
        self.process = None
        self.popen = None
        if os.environ.get("PIPEPLANNER_LAUNCH") != "subprocess" and "forkserver" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(FORK_SERVER_PRELOAD)
            self.process = context.Process(target=_rank_main, args=(argv, dict(os.environ, **env), log_path, stdout_path),
                                           daemon=False)
            self.process.start()
            return
        with open(log_path, "w") as log:
            out = open(stdout_path, "w") if stdout_path else log
            try:
                self.popen = subprocess.Popen([sys.executable, "-m", "runtime.worker", *argv], env=dict(os.environ, **env),
                                              stdout=out, stderr=log, stdin=subprocess.DEVNULL)
            finally:
                if out is not log:
                    out.close()

    def poll(self) -> Optional[int]:
        if self.popen is not None:
            return self.popen.poll()
        return self.process.exitcode

    def terminate(self) -> None:
        if self.poll() is None:
            (self.popen or self.process).terminate()

    def kill(self) -> None:
        if self.poll() is None:
            (self.popen or self.process).kill()

    def wait(self, timeout: Optional[float]) -> bool:
        """True once the process has exited (within `timeout` seconds)."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        self.process.join(timeout)
        return self.process.exitcode is not None


def _rank_main(argv: List[str], env: Dict[str, str], log_path: str, stdout_path: Optional[str]) -> None:
    """A forked rank: its environment (the launcher's now, not the fork server's when it started) and
    output files, then the worker."""
    os.environ.clear()
    os.environ.update(env)
    if END_WITH_PARENT in env:  # a forked rank's parent is the fork server, not `runtime execute`
        os.environ[END_WITH_PARENT] = str(os.getppid())
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    out = os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if stdout_path else log
    os.dup2(out, 1)
    os.dup2(log, 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    _leave_fork_server()
    _no_process_locks_for_progress_bars()
    from runtime.worker import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit handlers of the fork server's modules


def _no_process_locks_for_progress_bars() -> None:
    """torch.fx's Interpreter opens a (disabled) tqdm bar on every run, and tqdm's first bar makes a
    multiprocessing lock: a named semaphore, registered with the launcher's resource tracker, which a
    rank ending with os._exit never unlinks ("leaked semaphore objects" printed at the launcher's
    exit after a model whose stages are interpreted: one routing tokens by index). A rank's bars are
    never shared with another process: a thread lock is enough."""
    try:
        from tqdm import tqdm
    except ImportError:  # (optional: torch then uses its own stand-in, without a lock)
        return
    tqdm.set_lock(threading.RLock())


def _leave_fork_server() -> None:
    """Close this rank's end of the fork server's liveness pipe. multiprocessing hands it to every
    process the server forks, so that the server lives while any of them might use it; a rank never
    does, and with the pipe held the server outlived a killed `runtime execute`, and so did the
    ranks (their parent is the server: runtime.worker asks to end with it)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        try:
            os.close(alive)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _stop(procs: List[_Rank], grace_s: float = 5.0) -> None:
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.poll() is None and not p.wait(max(0.0, deadline - time.monotonic())):
            p.kill()
            p.wait(None)


class _Tail:
    """Copies what a file gains to a stream (the reporting rank's progress lines)."""

    def __init__(self, path: Optional[str], stream: TextIO):
        self.path, self.stream, self.offset = path, stream, 0

    def __call__(self) -> None:
        if self.path is None or not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data.rfind(b"\n") + 1  # whole lines only: never half a character
        if whole:
            self.offset += whole
            self.stream.write(data[:whole].decode("utf-8", errors="replace"))
            self.stream.flush()


def launch_local(world_size: int, worker_args: List[str], out_dir: str, threads: int,
                 timeout_s: float, progress_rank: Optional[int] = None) -> LaunchResult:
    """Run the worker with `worker_args` as ranks 0..world_size-1 and wait for all."""
    port = free_port()
    token = uuid.uuid4().hex[:16]  # names the run's shared-memory rings (runtime.shared_memory), removed below
    procs: List[_Rank] = []
    progress = os.path.join(out_dir, "progress.out") if progress_rank is not None else None
    tail = _Tail(progress, sys.stdout)
    try:
        for rank in range(world_size):
            env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                       **{RUN_TOKEN: token, END_WITH_PARENT: str(os.getpid())})
            argv = [*worker_args, "--timeout", str(timeout_s)] + (["--progress"] if rank == progress_rank else [])
            procs.append(_Rank(argv, env, os.path.join(out_dir, f"rank{rank}.log"),
                               progress if rank == progress_rank else None))
        while True:
            tail()
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # The first rank that wrote an error file is the cause; the others died of its absence.
                rank = _first_cause(out_dir, failed, codes)
                _stop(procs)
                return LaunchResult(False, rank, _read_error(out_dir, rank, codes[rank]),
                                    os.path.join(out_dir, f"rank{rank}.log"))
            if all(c == 0 for c in codes):
                tail()
                return LaunchResult(True)
            time.sleep(0.05)
    except BaseException:
        _stop(procs, grace_s=1.0)
        raise
    finally:
        remove_rings(token)  # what a killed rank left


def _first_cause(out_dir: str, failed: List[int], codes: List[Optional[int]]) -> int:
    """A rank killed by a signal (nothing here had stopped any yet), else the rank that wrote its
    error file first, exited or not: the others failed because it left. A rank writes its file
    before it leaves the group, but may still be leaving (printing, tearing down) when the peer
    that lost it has exited: the exited ranks alone could name the peer."""
    killed = [rank for rank in failed if codes[rank] is not None and codes[rank] < 0]
    if killed:
        return killed[0]
    stamped = []
    for rank in range(len(codes)):
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
        log = os.path.join(out_dir, f"rank{rank}.log")
        if not os.path.exists(log) or os.path.getsize(log) == 0:  # it never reached the worker
            return (f"exited with code {code} before starting its worker; if a script calls runtime.cli.main, "
                    f"call it under `if __name__ == \"__main__\":` (ranks start from a fork server, which imports "
                    f"the script again)")
        return f"exited with code {code} before reporting an error"
