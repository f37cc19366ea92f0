"""Co-runner processes: while `planner profile --ranks-per-host N` times the units, N - 1 other
processes run the model's own training step on the other cores, so the profile sees the
contention for cores, caches and memory bandwidth that N ranks sharing one CPU host have. They
also run the host-speed reference kernel on request (planner.profile.hostspeed), so the profile times it
under the same load as a run's ranks do."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, Optional, Sequence

import torch

from planner.model.entry import build_spec
from planner.profile.allocator import retain_freed_memory
from planner.profile.hostspeed import reference_kernel_s
from planner.profile.subnormal import set_flushing


def co_runner_main(argv: Optional[Sequence[str]] = None) -> None:
    """A co-runner process (`python -c "from planner.profile.corunners import co_runner_main; co_runner_main()" SPEC`):
    the model's whole training step (forward, loss, backward) in a loop, at the micro-batch size last
    read from stdin (one integer a line; 0 pauses, -1 runs the host-speed reference kernel instead),
    until stdin closes. Nothing it computes is kept."""
    import json
    import threading

    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    torch.set_num_threads(max(int(config["threads"]), 1))
    set_flushing(bool(config.get("flush_subnormals")))  # computing as the ranks will
    retain_freed_memory()
    spec = build_spec(config["entry"], config["args"], int(config["seed"]))
    from planner.model.spec import call_model

    state = {"b": 0, "stop": False}

    def read_commands() -> None:
        for line in sys.stdin:
            if line.strip():
                state["b"] = int(line)
        state["stop"] = True

    threading.Thread(target=read_commands, daemon=True).start()
    print("ready", flush=True)
    batches: Dict[int, Any] = {}
    while not state["stop"]:
        b = state["b"]
        if b == -1:
            reference_kernel_s(0.01)
            continue
        if b <= 0:
            time.sleep(0.001)
            continue
        if b not in batches:
            batches = {b: spec.batch(b, 0)}
        inputs, target = batches[b]
        loss = spec.loss(call_model(spec.module, inputs), target)
        loss.backward()
        spec.module.zero_grad(set_to_none=True)


class CoRunners:
    """`count` processes that load the other cores as the other ranks of a run on this host would:
    each runs the model's training step with the same threads (see `co_runner_main`)."""

    def __init__(self, entry: str, model_args: Dict[str, Any], seed: int, threads: int, count: int,
                 flush_subnormals: bool = False, timeout_s: float = 120.0):
        import json
        import select
        import subprocess

        config = json.dumps({"entry": entry, "args": dict(model_args), "seed": seed, "threads": threads,
                             "flush_subnormals": bool(flush_subnormals)})
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   OMP_NUM_THREADS=str(max(threads, 1)))
        code = "from planner.profile.corunners import co_runner_main; co_runner_main()"
        self.processes = [subprocess.Popen([sys.executable, "-c", code, config], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, env=env, text=True) for _ in range(count)]
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            line = ""
            while not line and proc.poll() is None and time.monotonic() < deadline:
                if select.select([proc.stdout], [], [], 0.1)[0]:
                    line = proc.stdout.readline()
            if line.strip() != "ready":
                code_ = proc.poll()
                self.stop()
                raise RuntimeError(f"a co-runner process did not start (exit code {code_}); it builds the model "
                                   "the same way `planner profile` does: check that MODEL imports in a new process")

    def load(self, micro_batch_size: int, settle_s: float = 0.2) -> None:
        """Run the load at this micro-batch size from now on (after a short settling time); -1:
        the host-speed reference kernel."""
        for proc in self.processes:
            proc.stdin.write(f"{int(micro_batch_size)}\n")
            proc.stdin.flush()
        time.sleep(settle_s)

    def stop(self) -> None:
        for proc in self.processes:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.processes:
            try:
                proc.wait(10)
            except Exception:
                proc.kill()
                proc.wait(5)


def host_kernel_s(co: Optional[CoRunners], dev: torch.device) -> Optional[float]:
    """The host-speed reference kernel's time now, with the co-runners running it too (as every
    rank of a run times it at once: planner.profile.hostspeed)."""
    if dev.type != "cpu":
        return None
    if co is not None:
        co.load(-1, settle_s=0.05)
    try:
        return reference_kernel_s(0.1)
    finally:
        if co is not None:
            co.load(0, settle_s=0.0)
