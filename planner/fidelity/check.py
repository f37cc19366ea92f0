"""Predicted vs measured: a run's report (`runtime execute --report`) checked against its plan, per
rank and overall, with the host's speed during the run against the profile's
(planner.profile.hostspeed). Correcting the profile from runs' reports is planner.fidelity.calibrate."""
from __future__ import annotations

from typing import Any, Dict, Optional

from planner.jsonio import JsonFileError, read_json
from planner.plan.file import Plan
from planner.profile.hostspeed import host_speed_lines


def load_report(path: str) -> Dict[str, Any]:
    """A `runtime execute --report` file, or a one-line error saying what it is instead."""
    report = read_json(path, what="report")
    if not isinstance(report, dict) or report.get("kind") != "report" or "stages" not in report:
        kind = report.get("kind", "no kind") if isinstance(report, dict) else type(report).__name__
        raise JsonFileError(f"{path!r} is not a run report ({kind}); pass the file `runtime execute PLAN "
                            "--report FILE` wrote")
    return report


def _rel(measured: float, predicted: float) -> Optional[float]:
    return (measured - predicted) / predicted if predicted else None


def check_report(plan: Plan, report: Dict[str, Any]) -> Dict[str, Any]:
    if report.get("model") != plan.model:
        raise ValueError("the report is of a different model than the plan; pass the plan the run executed")
    ranks = []
    for r in report["stages"]:
        if r.get("replica", 0) != 0:
            continue
        me, pr = r["measured"], r["predicted"]
        ranks.append({"rank": r["rank"], "chunks": r.get("chunks", [r["rank"]]),
                      "forward": (me["forward_s"], pr["forward_s"], _rel(me["forward_s"], pr["forward_s"])),
                      "backward": (me["backward_s"], pr["backward_s"], _rel(me["backward_s"], pr["backward_s"])),
                      "waiting_s": me.get("wait_s", me.get("recv_wait_s", 0.0) + me.get("send_wait_s", 0.0))})
    measured, predicted = report["measured_iteration_s"], plan.predicted_iteration_s
    return {"ranks": ranks, "iteration": (measured, predicted, _rel(measured, predicted)),
            "host_slowdown": report.get("host_slowdown")}


def format_check(result: Dict[str, Any]) -> str:
    def cell(triple) -> str:
        me, pr, rel = triple
        return f"{me * 1e3:9.2f} {pr * 1e3:9.2f} {'' if rel is None else f'{rel * 100:+6.1f}%':>7}"

    lines = [f"{'rank':>4}  {'forward ms: measured predicted error':<36}  {'backward ms: measured predicted error':<37}",
             ]
    for r in result["ranks"]:
        lines.append(f"{r['rank']:>4}  {cell(r['forward']):<36}  {cell(r['backward']):<37}")
    me, pr, rel = result["iteration"]
    lines.append(f"iteration: measured {me * 1e3:.2f} ms, predicted {pr * 1e3:.2f} ms, error "
                 f"{'n/a' if rel is None else f'{rel * 100:+.1f}%'}")
    lines += host_speed_lines(result.get("host_slowdown"), pr, me)
    return "\n".join(lines)
