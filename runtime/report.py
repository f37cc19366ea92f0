"""What a run measured, beside what the plan predicted."""
from __future__ import annotations

import statistics
from typing import Any, Dict, List


def _steady(values: List[float]) -> List[float]:
    """Drop the first step (warm-up: allocator, caches, lazy init) when there are others."""
    return values[1:] if len(values) > 1 else values


def build_report(plan: Dict[str, Any], rank_results: List[Dict[str, Any]]) -> Dict[str, Any]:
    rank_results = sorted(rank_results, key=lambda r: r["rank"])
    num_steps = len(rank_results[0]["steps"])
    last = rank_results[-1]
    m = int(plan["num_micro_batches"])
    steps = []
    for i in range(num_steps):
        steps.append({
            "step": i,
            "loss": last["steps"][i]["loss"],
            # A step ends when the slowest rank has finished its optimizer step.
            "time_s": max(r["steps"][i]["time_s"] for r in rank_results),
        })
    measured = statistics.median(_steady([s["time_s"] for s in steps]))
    stages = []
    for r, plan_stage in zip(rank_results, plan["stages"]):
        def mean(key: str) -> float:
            return statistics.mean(_steady([s[key] for s in r["steps"]]))
        stages.append({
            "stage": r["stage"],
            "units": plan_stage["units"],
            "measured": {"forward_s": mean("forward_s"), "backward_s": mean("backward_s"),
                         "recv_wait_s": mean("recv_wait_s"), "send_wait_s": mean("send_wait_s"),
                         "optimizer_s": mean("optimizer_s"), "step_s": mean("time_s")},
            "predicted": {"forward_s": m * float(plan_stage.get("forward_s", 0.0)),
                          "backward_s": m * float(plan_stage.get("backward_s", 0.0))},
            "threads": r.get("threads"),
            "device": r.get("device"),
            "peak_memory_bytes": r.get("peak_memory_bytes"),
        })
    predicted = float(plan.get("predicted_iteration_s", 0.0))
    return {
        "schema_version": 1,
        "kind": "report",
        "model": plan["model"],
        "schedule": plan["schedule"],
        "micro_batch_size": plan["micro_batch_size"],
        "num_micro_batches": m,
        "steps": steps,
        "stages": stages,
        "predicted_iteration_s": predicted,
        "measured_iteration_s": measured,
        "relative_error": (measured - predicted) / predicted if predicted > 0 else None,
    }


def format_report(report: Dict[str, Any]) -> str:
    lines = [f"{'stage':>5}  {'forward ms':>21}  {'backward ms':>21}  {'waiting ms':>10}  units",
             f"{'':>5}  {'measured':>10} {'predicted':>10}  {'measured':>10} {'predicted':>10}"]
    for s in report["stages"]:
        me, pr = s["measured"], s["predicted"]
        units = s["units"]
        span = units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)})"
        lines.append(f"{s['stage']:>5}  {me['forward_s'] * 1e3:>10.2f} {pr['forward_s'] * 1e3:>10.2f}  "
                     f"{me['backward_s'] * 1e3:>10.2f} {pr['backward_s'] * 1e3:>10.2f}  "
                     f"{(me['recv_wait_s'] + me['send_wait_s']) * 1e3:>10.2f}  {span}")
    p, m = report["predicted_iteration_s"], report["measured_iteration_s"]
    err = report.get("relative_error")
    lines.append(f"iteration: measured {m * 1e3:.2f} ms (median of steady steps), predicted {p * 1e3:.2f} ms"
                 + (f", error {err * 100:+.1f}%" if err is not None else ""))
    return "\n".join(lines)
