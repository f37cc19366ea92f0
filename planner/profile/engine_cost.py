"""What `runtime execute`'s engine adds per forward and backward to every stage's compute, measured
by runtime.engine_probe in a process of its own (the planner never imports the runtime; the process
starts the probe by module name, as the link's does)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Tuple


def measure_engine_overhead(threads: int, timeout_s: float = 300.0) -> Tuple[float, float]:
    """(forward s, backward s) per micro-batch, with `threads` torch threads, as the runs' ranks have;
    a RuntimeError with the probe's last line when it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS=str(max(threads, 1)))
    code = "from runtime.engine_probe import main; main()"
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps({"threads": threads})], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"measuring the engine's own cost took over {timeout_s:g} s") from None
    if done.returncode != 0:
        raise RuntimeError("measuring the engine's own cost failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
    try:
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        pair = (float(measured["forward_s"]), float(measured["backward_s"]))
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"the engine probe printed {done.stdout.strip()[-200:]!r}, not its two times") from None
    if not all(math.isfinite(x) and x >= 0 for x in pair):
        raise RuntimeError(f"the engine probe measured {pair}: times are finite and >= 0")
    return pair
