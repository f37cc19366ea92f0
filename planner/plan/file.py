"""The plan file: which units each stage runs, what crosses each cut, and the solver's certificate.

A plan is plain JSON (schema below, version PLAN_SCHEMA_VERSION). The runtime reads `stages`
(units in order; `recv`/`send` describe the values crossing the stage's first and end cut at the
plan's micro-batch size) and the planner's predictions sit beside them for comparison.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from planner.cost.options import CostOptions
from planner.jsonio import JsonFileError, read_json
from planner.profile.profile import Profile
from planner.sizes import format_bytes
from planner.solve.solution import Solution

PLAN_SCHEMA_VERSION = 1

REQUIRED_KEYS = ("kind", "model", "profile", "schedule", "optimizer", "global_batch", "micro_batch_size",
                 "num_micro_batches", "memory_per_device_bytes", "bandwidth_bytes_per_s", "latency_s",
                 "stages", "predicted_iteration_s", "bubble_fraction", "solver")
STAGE_KEYS = ("index", "units", "first_unit", "end_unit", "forward_s", "backward_s", "comm_s", "time_s",
              "in_flight", "memory_bytes", "recv", "send")
# Written by make_plan (schema 1 readers ignore unknown keys): schedule choice and joint decisions.
PLAN_DECISION_KEYS = ("data_parallel", "virtual_stages", "pipeline_stages")
STAGE_DECISION_KEYS = ("device", "recompute")
# Only when some stage is replicated (absent means 1): stage g runs on devices device .. device + replicas - 1.
REPLICA_STAGE_KEY = "replicas"


def make_plan(profile: Profile, solution: Solution, opts: CostOptions, profile_path: str) -> Dict[str, Any]:
    """The plan file's content for `solution` (as produced by planner.solve) of `profile`.

    `solution.options` (the scenario the solver chose: p, d, v, schedule) overrides `opts`.
    `stages` lists the p v chunks in model order; chunk c runs on pipeline rank `device` = c % p.
    Replicated stages (some r_g > 1) add `"replicas": r_g` to every stage, `device` = sum_{h<g} r_h
    (the first of its devices) and `pipeline_stages` = sum_g r_g; their `in_flight`, `memory_bytes`
    and `bubble_fraction` are per replica device.
    """
    opts = solution.options or opts
    b = solution.micro_batch_size
    cost = solution.cost
    last = len(cost.stages) - 1
    m, p = cost.num_micro_batches, cost.pipeline_stages
    pipeline_s = cost.iteration_s - cost.extra_s
    rank_work = [sum(st.time_s for st in cost.stages if st.device == i) for i in range(p)]
    replicated = any(st.replicas > 1 for st in cost.stages)
    stages: List[Dict[str, Any]] = []
    for index, st in enumerate(cost.stages):
        recv = [v.at(b) for v in profile.cut(st.first_unit).values] if index > 0 else []
        send = [v.at(b) for v in profile.cut(st.end_unit).values] if index < last else []
        stages.append({
            "index": index,
            "device": st.device,
            "units": [u.name for u in profile.units[st.first_unit:st.end_unit]],
            "first_unit": st.first_unit,
            "end_unit": st.end_unit,
            "recompute": [profile.units[l].name for l in st.recompute],
            "forward_s": st.forward_s,
            "backward_s": st.backward_s,
            "comm_s": st.comm_s,
            "time_s": st.time_s,
            "extra_s": st.extra_s,
            "in_flight": st.in_flight,
            "memory_bytes": {"params": st.param_bytes, "grads": st.grad_bytes, "optimizer": st.optimizer_bytes,
                             "activations": st.activation_bytes, "total": st.memory_bytes,
                             "device_total": cost.device_memory[st.device]},
            "memory_cap_bytes": cost.device_caps[st.device],
            "bubble_fraction": max(0.0, 1.0 - m * rank_work[st.device] / pipeline_s) if pipeline_s > 0 else 0.0,
            "recv": recv,
            "send": send,
        })
        if replicated:  # per replica device: in_flight, memory_bytes; busy for ceil(m / r) micro-batches
            busy = -(-m // st.replicas) * st.time_s
            stages[-1].update(replicas=st.replicas, bubble_fraction=max(0.0, 1.0 - busy / pipeline_s)
                              if pipeline_s > 0 else 0.0)
    model = profile.model or {}
    return {
        "schema_version": PLAN_SCHEMA_VERSION,
        "kind": "plan",
        "model": {"entry": model.get("entry"), "args": model.get("args", {}), "seed": model.get("seed", 0)},
        "profile": {"path": profile_path, "torch_version": profile.torch_version, "device": profile.device,
                    "device_name": profile.device_name, "threads": profile.threads, "dtype": profile.dtype,
                    "host_kernel_s": profile.host_kernel.get("mean_s")},
        "schedule": cost.schedule,
        "optimizer": opts.optimizer,
        "global_batch": opts.global_batch,
        "data_parallel": cost.data_parallel,
        "pipeline_stages": p,
        "virtual_stages": cost.virtual_stages,
        "micro_batch_size": b,
        "num_micro_batches": m,
        "memory_per_device_bytes": opts.memory_cap,
        "bandwidth_bytes_per_s": opts.bandwidth,
        "latency_s": opts.latency,
        # charged once per iteration whatever the split: step overhead + average rank's optimizer step
        "per_step_s": opts.per_step_s,
        "stages": stages,
        "predicted_iteration_s": cost.iteration_s,
        "bubble_fraction": cost.bubble_fraction,
        "solver": {"method": solution.method, "backend": solution.backend, "status": solution.status,
                   "objective": solution.objective, "bound": solution.bound, "gap": solution.gap,
                   "seconds": solution.seconds},
    }


def validate_plan(plan: Any, where: str = "plan") -> Dict[str, Any]:
    """Check a loaded plan's version and keys; raise JsonFileError saying how to fix it."""
    remake = "re-create it with `planner solve PROFILE`"
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
    if any("replicas" in st for st in stages):
        _validate_replicas(plan, where, remake)
    return plan


def _validate_replicas(plan: Dict[str, Any], where: str, remake: str) -> None:
    """Replicated stages: the runtime's own checks (r_g >= 1, device = sum_{h<g} r_h,
    pipeline_stages = sum r_g, v = 1, gpipe or 1f1b, at least max r_g micro-batches)."""
    from planner.pipeline.topology import TopologyError, topology_of

    try:
        topology_of(plan)
    except TopologyError as e:
        raise JsonFileError(f"{where}: {str(e).split('; re-run')[0]}; {remake}") from None


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
    """A fixed-width table of the stages (compute, transfer, memory against the cap, bubble share of
    the stage's device), then the batch split, schedule, prediction and certificate."""
    cap = plan.get("memory_per_device_bytes")
    caps = [st.get("memory_cap_bytes", cap) for st in plan["stages"]]
    any_cap = any(c for c in caps)
    mib = float(2 ** 20)
    chunked = plan.get("virtual_stages", 1) > 1
    replicated = any(st.get("replicas", 1) > 1 for st in plan["stages"])
    header = ["stage"] + (["device"] if chunked or replicated else []) + \
        (["replicas"] if replicated else []) + ["units", "compute ms", "transfer ms", "time ms",
                                                            "memory MiB" + (" / cap" if any_cap else ""), "bubble"]
    rows = []
    for st, c in zip(plan["stages"], caps):
        mem = st["memory_bytes"].get("device_total", st["memory_bytes"]["total"])
        memory = f"{mem / mib:.1f}" + (f" / {c / mib:.1f}" if c else "")
        units = _units_cell(st["units"]) + (f" r{len(st['recompute'])}" if st.get("recompute") else "")
        r = st.get("replicas", 1)
        device = str(st.get("device", 0)) + (f"-{st.get('device', 0) + r - 1}" if r > 1 else "")
        rows.append([str(st["index"])] + ([device] if chunked or replicated else []) +
                    ([str(r)] if replicated else []) +
                    [units, _ms(st["forward_s"] + st["backward_s"]), _ms(st["comm_s"]), _ms(st["time_s"]), memory,
                     f"{100 * st.get('bubble_fraction', plan['bubble_fraction']):.1f}%"])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    align_left = {header.index("units")}

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in align_left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
    out.append("")
    if replicated:
        out.append(f"replicated stages on {plan.get('pipeline_stages')} devices per data-parallel replica "
                   "(memory and bubble per replica device)")
    d = plan.get("data_parallel", 1)
    v = plan.get("virtual_stages", 1)
    out.append(f"micro-batch size {plan['micro_batch_size']} x {plan['num_micro_batches']} micro-batches"
               + (f" x {d} data-parallel replicas" if d > 1 else "")
               + f" (global batch {plan['global_batch']}), schedule {plan['schedule']}"
               + (f" with {v} chunks per device" if v > 1 else "") + f", optimizer {plan['optimizer']}")
    redo = sum(len(st.get("recompute", [])) for st in plan["stages"])
    out.append(f"predicted iteration time {_ms(plan['predicted_iteration_s'])} ms, "
               f"bubble {100 * plan['bubble_fraction']:.1f}%"
               + (f", memory cap {format_bytes(cap)} per device" if cap else "")
               + (f", {redo} units recomputed (rN in the units column)" if redo else ""))
    solver = plan["solver"]
    if solver.get("status") == "optimal":
        certificate = f"proven optimal for this cost model (gap {100 * (solver.get('gap') or 0.0):.2f}%)"
    elif solver.get("status") in ("heuristic", "infeasible"):
        certificate = f"{solver.get('method')} baseline, no optimality claim" + \
            (" (does NOT fit memory)" if solver.get("status") == "infeasible" else "")
    else:
        certificate = (f"best found, gap {100 * (solver.get('gap') or 0.0):.2f}% from the bound "
                       f"{_ms(solver.get('bound') or 0.0)} ms")
    out.append(f"{certificate} [{solver.get('method')}/{solver.get('backend')}, {solver.get('seconds', 0.0):.2f} s]")
    return "\n".join(out)


def plan_for_split(profile: Profile, boundaries: List[int], micro_batch_size: int, global_batch: int,
                   schedule: str = "1f1b", profile_path: str = "",
                   replicas: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """A plan with the given cuts, not solved (status "fixed"): for running a chosen split, as
    tests and benchmarks do to compare splits on real runs. `replicas`: r_g per stage (default 1)."""
    from planner.cost.model import evaluate

    opts = CostOptions(num_stages=len(boundaries) + 1, global_batch=global_batch, schedule=schedule,
                       replicas=tuple(replicas) if replicas else ())
    cost = evaluate(profile, boundaries, micro_batch_size, opts)
    solution = Solution(boundaries=list(boundaries), micro_batch_size=micro_batch_size,
                        num_micro_batches=global_batch // micro_batch_size, cost=cost, status="fixed",
                        objective=cost.iteration_s, bound=cost.iteration_s, gap=0.0, seconds=0.0,
                        method="fixed", backend="none")
    return make_plan(profile, solution, opts, profile_path)
