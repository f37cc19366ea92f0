"""The plan as a table: what `planner solve` and `planner show` print."""
from __future__ import annotations

from typing import List

from planner.plan.file import Plan
from planner.sizes import format_bytes


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _units_cell(units: List[str]) -> str:
    if len(units) == 1:
        return f"{units[0]} (1)"
    return f"{units[0]}..{units[-1]} ({len(units)})"


def format_plan_table(plan: Plan) -> str:
    """A fixed-width table of the stages (compute, transfer, memory against the cap, bubble share of
    the stage's device), then the batch split, schedule, prediction and certificate."""
    cap = plan.memory_per_device_bytes
    caps = [st.memory_cap_bytes for st in plan.stages]
    any_cap = any(c for c in caps)
    mib = float(2 ** 20)
    chunked = plan.virtual_stages > 1
    replicated = plan.replicated
    header = ["stage"] + (["device"] if chunked or replicated else []) + \
        (["replicas"] if replicated else []) + ["units", "compute ms", "transfer ms", "time ms",
                                                "memory MiB" + (" / cap" if any_cap else ""), "bubble"]
    rows = []
    for st, c in zip(plan.stages, caps):
        mem = st.memory_bytes.get("device_total", st.memory_bytes["total"])
        memory = f"{mem / mib:.1f}" + (f" / {c / mib:.1f}" if c else "")
        units = _units_cell(st.units) + (f" r{len(st.recompute)}" if st.recompute else "")
        r, first = st.replica_count, st.device or 0
        device = str(first) + (f"-{first + r - 1}" if r > 1 else "")
        bubble = plan.bubble_fraction if st.bubble_fraction is None else st.bubble_fraction
        rows.append([str(st.index)] + ([device] if chunked or replicated else []) +
                    ([str(r)] if replicated else []) +
                    [units, _ms(st.forward_s + st.backward_s), _ms(st.comm_s), _ms(st.time_s), memory,
                     f"{100 * bubble:.1f}%"])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    align_left = {header.index("units")}

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in align_left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
    out.append("")
    out += _summary(plan, cap)
    return "\n".join(out)


def _summary(plan: Plan, cap) -> List[str]:
    """The lines under the table: batch split and schedule, prediction, certificate."""
    out = []
    if plan.replicated:
        out.append(f"replicated stages on {plan.pipeline_stages} devices per data-parallel replica "
                   "(memory and bubble per replica device)")
    d, v = plan.data_parallel, plan.virtual_stages
    out.append(f"micro-batch size {plan.micro_batch_size} x {plan.num_micro_batches} micro-batches"
               + (f" x {d} data-parallel replicas" if d > 1 else "")
               + f" (global batch {plan.global_batch}), schedule {plan.schedule}"
               + (f" with {v} stages per device" if v > 1 else "") + f", optimizer {plan.optimizer}")
    if plan.sync_every > 1:
        charged = max(plan.step_durations.get("reduce", []), default=0.0)
        out.append(f"local SGD: each replica trains alone and the replicas average their models every "
                   f"{plan.sync_every} steps ({_ms(plan.averaging_s or 0.0)} ms each, {_ms(charged)} ms per step "
                   "charged: the predicted iteration is the mean step over those steps); no per-step gradient "
                   "all-reduce")
    if plan.placement:
        out.append("placement (device of each pipeline rank): " +
                   "; ".join(f"replica {r}: {' '.join(map(str, row))}" for r, row in enumerate(plan.placement)))
    redo = sum(len(st.recompute) for st in plan.stages)
    out.append(f"predicted iteration time {_ms(plan.predicted_iteration_s)} ms, "
               f"bubble {100 * plan.bubble_fraction:.1f}%"
               + (f", memory cap {format_bytes(cap)} per device" if cap else "")
               + (f", {redo} units recomputed (rN in the units column)" if redo else ""))
    solver = plan.solver
    if solver.get("status") == "optimal":
        certificate = f"proven optimal for this cost model (gap {100 * (solver.get('gap') or 0.0):.2f}%)"
    elif solver.get("status") in ("heuristic", "infeasible"):
        certificate = f"{solver.get('method')} baseline, no optimality claim" + \
            (" (does NOT fit memory)" if solver.get("status") == "infeasible" else "")
    else:
        certificate = (f"best found, gap {100 * (solver.get('gap') or 0.0):.2f}% from the bound "
                       f"{_ms(solver.get('bound') or 0.0)} ms")
        requested = solver.get("requested_gap")  # --gap: the search stopped once within it
        if requested is not None and (solver.get("gap") or 0.0) <= requested:
            certificate += f" (within the {100 * requested:.2f}% asked for: proven)"
    out.append(f"{certificate} [{solver.get('method')}/{solver.get('backend')}, {solver.get('seconds') or 0.0:.2f} s]")
    return out
