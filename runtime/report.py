"""What a run measured, beside what the plan predicted."""
from __future__ import annotations

import statistics
from typing import Any, Dict, List

from planner.fidelity.check import REPORT_SCHEMA_VERSION
from planner.plan.file import Plan
from planner.profile.hostspeed import host_slowdown, host_speed_lines
from planner.sizes import format_bytes

HELD_TOLERANCE = 1e-3  # of the planned bytes: what rounding in a rank's count may add
MEASURED_KEYS = ("forward_s", "backward_s", "wait_s", "reduce_s", "optimizer_s", "time_s")


def _steady(values: List[float]) -> List[float]:
    """Drop the first step (warm-up: allocator, caches, lazy init) when there are others."""
    return values[1:] if len(values) > 1 else values


def build_report(plan: Plan, rank_results: List[Dict[str, Any]]) -> Dict[str, Any]:
    rank_results = sorted(rank_results, key=lambda r: r["rank"])
    num_steps = len(rank_results[0]["steps"])
    reporter = max((r for r in rank_results if r.get("replica", 0) == 0), key=lambda r: max(r.get("chunks", [0])))
    m = plan.num_micro_batches
    steps = []
    for j in range(num_steps):
        steps.append({
            "step": reporter["steps"][j]["step"],
            "loss": reporter["steps"][j]["loss"],
            # A step ends when the slowest rank has finished its optimizer step.
            "time_s": max(r["steps"][j]["time_s"] for r in rank_results),
        })
    # local SGD: its prediction is the mean step over the averaging period (planner.cost.localsgd), so
    # the steps' mean, averaging steps included; else the median (robust to a noisy step)
    summary = statistics.mean if plan.sync_every > 1 else statistics.median
    measured = summary(_steady([s["time_s"] for s in steps])) if steps else 0.0
    ranks = []
    lists = plan.instruction_lists()
    for r in rank_results:
        stages = r.get("chunks", [r["rank"]])  # the rank's stages ("chunks" in the rank and report files)
        plan_stages = [plan.stages[g] for g in stages]
        counts = r.get("micro_batches") or {}  # micro-batches per stage (a stage's lane runs its share)
        mean = {k: statistics.mean(_steady([s.get(k, 0.0) for s in r["steps"]])) if r["steps"] else 0.0
                for k in MEASURED_KEYS}
        mean["step_s"] = mean.pop("time_s")
        busy = sum(mean[k] for k in ("forward_s", "backward_s", "reduce_s", "optimizer_s"))
        mean["idle_s"] = max(0.0, mean["step_s"] - busy)  # waiting on neighbours: the bubble and transfers
        units = [u for st in plan_stages for u in st.units]
        spans = [st.units[0] if len(st.units) == 1 else f"{st.units[0]}..{st.units[-1]}" for st in plan_stages]
        ranks.append({
            "rank": r["rank"],
            "stage": r.get("pipeline_rank", r["rank"]),
            "replica": r.get("replica", 0),
            "lane": r.get("lane", 0),
            "chunks": stages,
            "units": units,
            "unit_spans": spans,
            "measured": mean,
            "predicted": {kind: sum(counts.get(str(g), m) * float(getattr(plan.stages[g], kind)) for g in stages)
                          for kind in ("forward_s", "backward_s")},
            "threads": r.get("threads"),
            "flush_subnormals": r.get("flush_subnormals"),  # as the rank computed (planner.profile.subnormal)
            "shared_memory_peers": r.get("shared_memory_peers", []),  # runtime/shared_memory.py
            "shared_memory_messages": r.get("shared_memory_messages", 0),
            "gradient_all_reduce": r.get("gradient_all_reduce"),  # runtime/shared_reduce.py
            "shared_memory_reductions": r.get("shared_memory_reductions", 0),
            "tie_all_reduce": r.get("tie_all_reduce"),
            "p2p_note": r.get("p2p_note", ""),
            "precision_note": r.get("precision_note", ""),  # planner/model/casts.py
            "init_state_note": r.get("init_state_note", ""),  # runtime/initstate.py
            "host_kernel_s": r.get("host_kernel_s"),
            "device": r.get("device"),
            "peak_memory_bytes": r.get("peak_memory_bytes"),  # the CUDA allocator's peak (None on the CPU)
            "peak_rss_bytes": r.get("peak_rss_bytes"),  # the process's peak resident memory
            "start_rss_bytes": r.get("start_rss_bytes"),  # ... before it built anything
            "built_rss_bytes": r.get("built_rss_bytes"),  # the peak once its stages were built (no step yet)
            # the plan's memory of this rank's device (its stages' device_total)
            "predicted_memory_bytes": float(plan_stages[0].memory_bytes.get(
                "device_total", sum(float(st.memory_bytes.get("total", 0)) for st in plan_stages))) if plan_stages else None,
            "peak_saved_bytes": r.get("peak_saved_bytes"),
            "param_bytes": r.get("param_bytes"),
            "predicted_activation_bytes": _planned_live_peak(plan, lists, r.get("pipeline_rank", r["rank"]), stages),
        })
    predicted = float(plan.predicted_iteration_s)
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "kind": "report",
        "plan_sha256": plan.digest(),  # the plan file every rank ran (planner check warns on another)
        "model": plan.model,
        "schedule": plan.schedule,
        "micro_batch_size": plan.micro_batch_size,
        "num_micro_batches": m,
        "data_parallel": plan.data_parallel,
        "optimizer": rank_results[0].get("optimizer"),
        "engine": rank_results[0].get("engine", "own"),
        "steps": steps,
        "stages": ranks,
        "predicted_iteration_s": predicted,
        "measured_iteration_s": measured,
        "measured_iteration_is": "mean" if plan.sync_every > 1 else "median",
        "relative_error": (measured - predicted) / predicted if predicted > 0 else None,
        "link": next((r["link"] for r in rank_results if r.get("link")), None),
        # the host's speed during the run against the profile's (planner.profile.hostspeed)
        "host_slowdown": host_slowdown(plan.profile.get("host_kernel_s"),
                                       [r.get("host_kernel_s") or [] for r in rank_results]),
    }


def format_report(report: Dict[str, Any]) -> str:
    lines = [f"{'rank':>4}  {'forward ms':>21}  {'backward ms':>21}  {'waiting ms':>10}  "
             f"{'held for backward MiB':>21}  units",
             f"{'':>4}  {'measured':>10} {'predicted':>10}  {'measured':>10} {'predicted':>10}  {'':>10}  "
             f"{'measured':>10} {'predicted':>10}"]
    for s in report["stages"]:
        me, pr = s["measured"], s["predicted"]
        span = " + ".join(s["unit_spans"]) + f" ({len(s['units'])} units)"
        if len(s["chunks"]) > 1:
            span = f"stages {','.join(map(str, s['chunks']))}: {span}"
        lines.append(f"{s['rank']:>4}  {me['forward_s'] * 1e3:>10.2f} {pr['forward_s'] * 1e3:>10.2f}  "
                     f"{me['backward_s'] * 1e3:>10.2f} {pr['backward_s'] * 1e3:>10.2f}  "
                     f"{me['wait_s'] * 1e3:>10.2f}  "
                     f"{(s.get('peak_saved_bytes') or 0) / 2**20:>10.2f} {s.get('predicted_activation_bytes', 0) / 2**20:>10.2f}"
                     f"  {span}")
    lines += _held_above_plan(report)
    for s in report["stages"]:
        if s.get("peak_memory_bytes") is not None:
            lines.append(f"rank {s['rank']} device memory: peak {s['peak_memory_bytes'] / 2**20:.1f} MiB (CUDA allocator), "
                         f"planned {(s.get('predicted_memory_bytes') or 0) / 2**20:.1f} MiB")
    p, m = report["predicted_iteration_s"], report["measured_iteration_s"]
    err = report.get("relative_error")
    summary = report.get("measured_iteration_is", "median")
    lines.append(f"iteration: measured {m * 1e3:.2f} ms ({summary} of steady steps), predicted {p * 1e3:.2f} ms"
                 + (f", error {err * 100:+.1f}%" if err is not None else ""))
    lines += host_speed_lines(report.get("host_slowdown"), p, m)
    ringed = [s["rank"] for s in report["stages"] if s.get("shared_memory_messages")]
    if ringed and len(report["stages"]) > 1:  # runtime/shared_memory.py; absent: torch.distributed carried them
        lines.append(f"messages through shared memory on ranks {_ranges(ringed)}" + (
            "" if len(ringed) == len(report["stages"]) else ", torch.distributed on the others"))
    summed = [s["rank"] for s in report["stages"] if s.get("gradient_all_reduce") == "shared memory"]
    others = [s["rank"] for s in report["stages"] if s.get("gradient_all_reduce") == "torch.distributed"]
    if summed:  # runtime/shared_reduce.py; ranks without gradient buckets are in neither
        lines.append(f"gradient all-reduce through shared memory on ranks {_ranges(summed)}" + (
            f", torch.distributed on ranks {_ranges(others)}" if others else ""))
    # why the rings were not used (every rank decided alike); why a bf16-mixed graph kept fp32 casts; the
    # --init-state entries not loaded
    notes = {s.get(key) for s in report["stages"]
             for key in ("p2p_note", "precision_note", "init_state_note")} - {"", None}
    lines += sorted(notes)
    return "\n".join(lines)


def _held_above_plan(report: Dict[str, Any]) -> List[str]:
    """A note naming the ranks that held more for backward than the plan says (the plan is sized by it),
    with why where it is known: torch's ZBV orders its weight backwards by its own rules."""
    over = [(s["rank"], s["peak_saved_bytes"], s["predicted_activation_bytes"]) for s in report["stages"]
            if s.get("peak_saved_bytes") and s.get("predicted_activation_bytes") is not None
            and s["peak_saved_bytes"] > s["predicted_activation_bytes"] * (1 + HELD_TOLERANCE)]
    if not over:
        return []
    why = (" (--engine torch orders zb-v's weight backwards by its own rules; the plan is for this project's lists)"
           if report.get("engine") == "torch" and report.get("schedule") == "zb-v" else "")
    return ["note: held for backward more than planned on " + ", ".join(
        f"rank {rank} ({format_bytes(held)}" + (f", {100 * (held / planned - 1):+.1f} %)" if planned else ")")
        for rank, held, planned in over) + why]


def _ranges(ranks: List[int]) -> str:
    """0-3, 6 for [0, 1, 2, 3, 6]."""
    spans: List[List[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def _planned_live_peak(plan, lists, pipeline_rank: int, stages) -> float:
    """The most bytes the plan has this rank's stages hold for backward at once: the peak, along
    the rank's list, of each stage's micro-batches in flight times what each holds (zero-bubble:
    from the input part to the weight part, what the weight part reads and the kept gradients),
    what the saved-tensor hooks measure (received buffers are not saved tensors). Summing each
    stage's own peak would count stages that peak at different moments twice. Plans written before
    the per-micro-batch bytes were kept: a stage's activations over its micro-batches in flight."""
    from planner.pipeline.stepgraph import held_peaks

    held = {}
    for g in stages:
        memory = plan.stages[g].memory_bytes
        if "saved_per_micro_batch" in memory:
            saved = float(memory["saved_per_micro_batch"])
            held[("live", g)], held[("weight", g)] = saved, float(memory.get("weight_held_per_micro_batch", saved))
        elif plan.stages[g].in_flight:
            held[("live", g)] = float(memory.get("activations", 0)) / plan.stages[g].in_flight
    if not 0 <= pipeline_rank < len(lists):
        return sum(float(plan.stages[g].memory_bytes.get("activations", 0)) for g in stages)
    return max((sum(n * held.get(term, 0.0) for term, n in peak.items()) for peak in held_peaks(lists[pipeline_rank])),
               default=0.0)
