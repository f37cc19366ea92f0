"""Shared by the benchmark scripts: run a plan with `runtime execute` and read its report."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from planner.jsonio import read_json  # noqa: E402
from planner.plan.file import Plan, save_plan  # noqa: E402


def run_plan(plan: Plan, steps: int, extra_args=()) -> dict:
    """Execute `plan` for `steps` steps (1 thread per rank) and return its report."""
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, report_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "report.json")
        save_plan(plan, plan_path)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        result = subprocess.run([sys.executable, "-m", "runtime.cli", "execute", plan_path, "--steps", str(steps),
                                 "--report", report_path, *extra_args], cwd=ROOT, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(result.stderr)
        return read_json(report_path)
