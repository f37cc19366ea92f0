"""The plan file: which units each stage runs, what crosses each cut, and the solver's certificate.

A plan is plain JSON (schema below, version PLAN_SCHEMA_VERSION). The runtime reads `stages`
(units in order; `recv`/`send` describe the values crossing the stage's first and end cut at the
plan's micro-batch size) and the planner's predictions sit beside them for comparison.
"""
from __future__ import annotations

from typing import Any, Dict, List

from planner.costmodel import CostOptions
from planner.jsonio import JsonFileError, read_json
from planner.profile import Profile
from planner.solve.diagnose import format_bytes
from planner.solve.ilp import Solution

PLAN_SCHEMA_VERSION = 1

REQUIRED_KEYS = ("kind", "model", "profile", "schedule", "optimizer", "global_batch", "micro_batch_size",
                 "num_micro_batches", "memory_per_device_bytes", "bandwidth_bytes_per_s", "latency_s",
                 "stages", "predicted_iteration_s", "bubble_fraction", "solver")
STAGE_KEYS = ("index", "units", "first_unit", "end_unit", "forward_s", "backward_s", "comm_s", "time_s",
              "in_flight", "memory_bytes", "recv", "send")


def make_plan(profile: Profile, solution: Solution, opts: CostOptions, profile_path: str) -> Dict[str, Any]:
    """The plan file's content for `solution` (as produced by planner.solve) of `profile`."""
    b = solution.micro_batch_size
    cost = solution.cost
    last = len(cost.stages) - 1
    stages: List[Dict[str, Any]] = []
    for index, st in enumerate(cost.stages):
        recv = [v.at(b) for v in profile.cut(st.first_unit).values] if index > 0 else []
        send = [v.at(b) for v in profile.cut(st.end_unit).values] if index < last else []
        stages.append({
            "index": index,
            "units": [u.name for u in profile.units[st.first_unit:st.end_unit]],
            "first_unit": st.first_unit,
            "end_unit": st.end_unit,
            "forward_s": st.forward_s,
            "backward_s": st.backward_s,
            "comm_s": st.comm_s,
            "time_s": st.time_s,
            "in_flight": st.in_flight,
            "memory_bytes": {"params": st.param_bytes, "grads": st.grad_bytes, "optimizer": st.optimizer_bytes,
                             "activations": st.activation_bytes, "total": st.memory_bytes},
            "recv": recv,
            "send": send,
        })
    model = profile.model or {}
    return {
        "schema_version": PLAN_SCHEMA_VERSION,
        "kind": "plan",
        "model": {"entry": model.get("entry"), "args": model.get("args", {}), "seed": model.get("seed", 0)},
        "profile": {"path": profile_path, "torch_version": profile.torch_version, "device": profile.device,
                    "device_name": profile.device_name, "threads": profile.threads, "dtype": profile.dtype},
        "schedule": opts.schedule,
        "optimizer": opts.optimizer,
        "global_batch": opts.global_batch,
        "micro_batch_size": b,
        "num_micro_batches": solution.num_micro_batches,
        "memory_per_device_bytes": opts.memory_cap,
        "bandwidth_bytes_per_s": opts.bandwidth,
        "latency_s": opts.latency,
        "stages": stages,
        "predicted_iteration_s": cost.iteration_s,
        "bubble_fraction": cost.bubble_fraction,
        "solver": {"method": solution.method, "backend": solution.backend, "status": solution.status,
                   "objective": solution.objective, "bound": solution.bound, "gap": solution.gap,
                   "seconds": solution.seconds},
    }


def validate_plan(plan: Any, where: str = "plan") -> Dict[str, Any]:
    """Check a loaded plan's version and keys; raise JsonFileError saying how to fix it."""
    remake = "re-create it with `planner plan PROFILE`"
    if not isinstance(plan, dict) or plan.get("kind") != "plan":
        raise JsonFileError(f"{where} is not a plan file (no \"kind\": \"plan\"); {remake}")
    version = plan.get("schema_version")
    if version != PLAN_SCHEMA_VERSION:
        raise JsonFileError(f"{where} has schema_version {version!r}, expected {PLAN_SCHEMA_VERSION}; {remake}")
    missing = [k for k in REQUIRED_KEYS if k not in plan]
    if missing:
        raise JsonFileError(f"{where} lacks {', '.join(missing)}; {remake}")
    stages = plan["stages"]
    if not isinstance(stages, list) or not stages:
        raise JsonFileError(f"{where} has no stages; {remake}")
    for i, st in enumerate(stages):
        absent = [k for k in STAGE_KEYS if not isinstance(st, dict) or k not in st]
        if absent:
            raise JsonFileError(f"{where} stage {i} lacks {', '.join(absent)}; {remake}")
        if st["index"] != i:
            raise JsonFileError(f"{where} stage {i} has index {st['index']!r}; {remake}")
    return plan


def load_plan(path: str) -> Dict[str, Any]:
    """Read and validate a plan file."""
    return validate_plan(read_json(path, what="plan"), where=f"plan {path!r}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _units_cell(units: List[str]) -> str:
    if len(units) == 1:
        return f"{units[0]} (1)"
    return f"{units[0]}..{units[-1]} ({len(units)})"


def format_plan_table(plan: Dict[str, Any]) -> str:
    """A fixed-width table of the stages, then the batch split, schedule, prediction and certificate."""
    cap = plan.get("memory_per_device_bytes")
    mib = float(2 ** 20)
    header = ["stage", "units", "compute ms", "transfer ms", "time ms", "memory MiB" + (" / cap" if cap else "")]
    rows = []
    for st in plan["stages"]:
        memory = f"{st['memory_bytes']['total'] / mib:.1f}" + (f" / {cap / mib:.1f}" if cap else "")
        rows.append([str(st["index"]), _units_cell(st["units"]), _ms(st["forward_s"] + st["backward_s"]),
                     _ms(st["comm_s"]), _ms(st["time_s"]), memory])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    align_left = {1}

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in align_left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
    out.append("")
    out.append(f"micro-batch size {plan['micro_batch_size']} x {plan['num_micro_batches']} micro-batches "
               f"(global batch {plan['global_batch']}), schedule {plan['schedule']}, optimizer {plan['optimizer']}")
    out.append(f"predicted iteration time {_ms(plan['predicted_iteration_s'])} ms, "
               f"bubble {100 * plan['bubble_fraction']:.1f}%"
               + (f", memory cap {format_bytes(cap)} per device" if cap else ""))
    solver = plan["solver"]
    if solver.get("status") == "optimal":
        certificate = f"proven optimal for this cost model (gap {100 * (solver.get('gap') or 0.0):.2f}%)"
    else:
        certificate = (f"best found, gap {100 * (solver.get('gap') or 0.0):.2f}% from the bound "
                       f"{_ms(solver.get('bound') or 0.0)} ms")
    out.append(f"{certificate} [{solver.get('method')}/{solver.get('backend')}, {solver.get('seconds', 0.0):.2f} s]")
    return "\n".join(out)
