"""Predicted vs measured: a run's report (`runtime execute --report`) checked against its plan, per
rank and overall, with the host's speed during the run against the profile's
(planner.profile.hostspeed). Correcting the profile from runs' reports is planner.fidelity.calibrate."""
from __future__ import annotations

from typing import Any, Dict, Optional

from planner.jsonio import JsonFileError, newer_schema, read_json
from planner.fidelity.simulation import replay_s
from planner.plan.file import Plan
from planner.profile.hostspeed import host_speed_lines
from planner.profile.reader import MAX_SECONDS


REPORT_SCHEMA_VERSION = 1  # runtime.report writes it


def load_report(path: str) -> Dict[str, Any]:
    """A `runtime execute --report` file, or a one-line error saying what it is instead."""
    report = read_json(path, what="report")
    if not isinstance(report, dict) or report.get("kind") != "report" or "stages" not in report:
        kind = report.get("kind", "no kind") if isinstance(report, dict) else type(report).__name__
        raise JsonFileError(f"{path!r} is not a run report ({kind}); pass the file `runtime execute PLAN "
                            "--report FILE` wrote")
    version = report.get("schema_version")
    if version != REPORT_SCHEMA_VERSION or isinstance(version, bool):
        raise JsonFileError(f"report {path!r} has schema_version {version!r}; this planner reads version "
                            f"{REPORT_SCHEMA_VERSION}: {newer_schema(version, REPORT_SCHEMA_VERSION)}run `runtime "
                            "execute PLAN --report FILE` again with this version")
    problem = _report_problem(report)
    if problem:
        raise JsonFileError(f"report {path!r} {problem}; pass the file `runtime execute PLAN --report FILE` wrote")
    return report


def other_plan(plan: Plan, report: Dict[str, Any]) -> Optional[str]:
    """A one-line warning where the report names another plan file than `plan` (its sha256, which
    every rank checked; reports of older runs name none), else None: a plan solved again for the same
    split passes the checks of model and units, but its predictions are not the run's."""
    ran, this = report.get("plan_sha256"), plan.digest()
    if not isinstance(ran, str) or ran == this:
        return None
    return (f"warning: the report is of another plan file (sha256 {ran[:12]}…, this plan's {this[:12]}…): "
            "its measurements are set beside this plan's predictions")


def _seconds(x: Any) -> bool:
    """A measured time or ratio: a number in [0, MAX_SECONDS] (past it, a broken file that would carry
    into a calibrated profile)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= MAX_SECONDS


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf")


def _index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _report_problem(report: Dict[str, Any]) -> Optional[str]:
    """What is wrong with the fields a check or a calibration reads, or None."""
    for key in ("measured_iteration_s", "predicted_iteration_s"):
        if not _seconds(report.get(key)) or not report[key] > 0:
            return f"has {key} {report.get(key)!r}, not seconds > 0"
    stages = report["stages"]
    if not isinstance(stages, list) or not stages or not all(isinstance(r, dict) for r in stages):
        return "has no list of ranks under stages"
    for k, r in enumerate(stages):
        if not _index(r.get("rank")) or not _index(r.get("replica", 0)):
            return f"stages[{k}] has no rank (an index)"
        chunks = r.get("chunks", [r["rank"]])
        if not isinstance(chunks, list) or not chunks or not all(_index(g) for g in chunks):
            return f"stages[{k}].chunks is not a list of stage indices"
        if not isinstance(r.get("units"), list) or not all(isinstance(u, str) for u in r["units"]):
            return f"stages[{k}].units is not a list of names"
        for part in ("measured", "predicted"):
            times = r.get(part)
            if not isinstance(times, dict) or not all(_seconds(times.get(t)) for t in ("forward_s", "backward_s")):
                return f"stages[{k}].{part} lacks forward_s and backward_s in seconds >= 0"
            if not all(_seconds(v) for v in times.values() if isinstance(v, (int, float)) or v is None):
                return f"stages[{k}].{part} has a time that is not seconds >= 0"
    ranks = [(r["rank"], r.get("replica", 0)) for r in stages]
    if len(set(ranks)) != len(ranks):
        return "names one rank twice under stages"
    slowdown = report.get("host_slowdown")
    if slowdown is not None:
        per_rank = slowdown.get("per_rank") if isinstance(slowdown, dict) else None
        if not (isinstance(per_rank, list) and all(r is None or _seconds(r) and r > 0 for r in per_rank)
                and any(r is not None for r in per_rank)
                and all(_seconds(slowdown.get(key)) and slowdown[key] > 0 for key in ("fastest", "slowest"))
                and slowdown["slowest"] == max(r for r in per_rank if r is not None)
                and slowdown["fastest"] == min(r for r in per_rank if r is not None)):
            return "has host_slowdown without ratios > 0 per rank, fastest and slowest among them"
    link = report.get("link") or {}
    if not isinstance(link, dict):
        return "has a link that is not an object"
    for key, ok in (("bandwidth_bytes_per_s", _finite), ("latency_s", _seconds)):
        if link.get(key) is not None and not ok(link[key]):
            return f"has link.{key} {link[key]!r}, not a number >= 0"
    b = report.get("micro_batch_size")
    if b is not None and not (_index(b) and b > 0):
        return f"has micro_batch_size {b!r}, not an integer > 0"
    return None


def _rel(measured: float, predicted: float) -> Optional[float]:
    return (measured - predicted) / predicted if predicted else None


def check_report(plan: Plan, report: Dict[str, Any]) -> Dict[str, Any]:
    if report.get("model") != plan.model:
        raise ValueError("the report is of a different model than the plan; pass the plan the run executed")
    for r in report["stages"]:  # the same model, another split: the ranks ran other units
        chunks = r.get("chunks", [r["rank"]])
        if r.get("replica", 0) == 0 and "units" in r and (any(g >= len(plan.stages) for g in chunks) or
                                                          r["units"] != [u for g in chunks for u in plan.stages[g].units]):
            raise ValueError(f"the report's rank {r['rank']} ran other units than the plan gives it; pass the plan "
                             "the run executed")
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
    replayed = replay_s(plan, report)
    return {"ranks": ranks, "iteration": (measured, predicted, _rel(measured, predicted)),
            "replayed": (measured, replayed, _rel(measured, replayed)), "host_slowdown": report.get("host_slowdown")}


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
    if result.get("replayed"):
        _, replayed, rel = result["replayed"]
        lines.append(f"at the run's measured compute the plan's lists take {replayed * 1e3:.2f} ms, error "
                     f"{'n/a' if rel is None else f'{rel * 100:+.1f}%'} (what is left: waits, messages, per-action "
                     "work; the rest of the error above is the compute's speed)")
    lines += host_speed_lines(result.get("host_slowdown"), pr, me)
    return "\n".join(lines)
