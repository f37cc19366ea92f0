"""Correct a profile from what runs measured (`planner calibrate PROFILE REPORT... --plan PLAN...`).

One round of calibration takes one or more runs, each a (plan, report) pair, of plans split from
this profile or from another profile of the same model (every prediction is recomputed from this
profile, so runs planned from other measurements of the model calibrate it too):

- unit scale factors: a unit's forward (backward) time at micro-batch size b is multiplied by the
  median, over the runs at size b, of measured / predicted forward (backward) compute of the rank
  that ran it; sizes no run measured take the median over all runs. Several runs average out the
  noise one run carries (a shared host's speed drifts by several % from one run to the next).
  A stage's own cost (the profile's stage_overhead_s) takes the median over every rank;
- the link: the median bandwidth and latency the runs' reports measured;
- what the corrected model still misses is charged first as extra per-message latency (it grows
  with the number of transfers, as Python and gloo overheads do), chosen so that the multi-stage
  runs are predicted right on average, then as a per-step overhead (the median over the runs of
  what is left, at least 0).
"""
from __future__ import annotations

import copy
import statistics
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from planner.cost.model import evaluate
from planner.cost.options import DEFAULT_BANDWIDTH, CostOptions
from planner.cost.result import PlanCost
from planner.plan.file import Plan
from planner.profile.profile import Profile

Run = Tuple[Plan, Dict[str, Any]]  # (plan, report)


def _evaluate_plan(profile: Profile, plan: Plan, bandwidth: float, latency: float) -> PlanCost:
    """The cost model's view of the split `plan` executed, on `profile`, with this link."""
    names = [u.name for u in profile.units]
    boundaries = [st.first_unit for st in plan.stages[1:]]
    recompute = [names.index(u) for st in plan.stages for u in st.recompute]
    replicas = tuple(st.replica_count for st in plan.stages)
    opts = CostOptions(pipeline_ranks=plan.pipeline_stages or len(plan.stages), global_batch=plan.global_batch,
                       schedule=plan.schedule, bandwidth=bandwidth, latency=latency, optimizer=plan.optimizer,
                       data_parallel=plan.data_parallel, virtual_stages=plan.virtual_stages,
                       replicas=replicas if any(r != 1 for r in replicas) else (),
                       message_s=plan.message_s)
    return evaluate(profile, boundaries, plan.micro_batch_size, opts, recompute)


def _check_run(profile: Profile, plan: Plan, report: Dict[str, Any]) -> None:
    if report.get("model") != profile.model:
        raise ValueError("a report is of a different model than the profile")
    if plan.model != profile.model:
        raise ValueError("a plan is of a different model than the profile")
    names = set(u.name for u in profile.units)
    for r in report["stages"]:
        for unit_name in r["units"]:
            if unit_name not in names:
                raise ValueError(f"the report's unit {unit_name!r} is not in the profile")
    if int(report.get("micro_batch_size") or plan.micro_batch_size) != plan.micro_batch_size:
        raise ValueError("a report and its plan differ in micro-batch size: pass each report with the plan it ran")
    if any(not 0 <= g < len(plan.stages) for r in report["stages"] if r.get("replica", 0) == 0
           for g in r.get("chunks", [r["rank"]])):
        raise ValueError(f"a report names stages its plan lacks (the plan has {len(plan.stages)}): pass each report "
                         "with the plan it ran")


def _rank_ratios(profile: Profile, plan: Plan, report: Dict[str, Any]) -> List[Tuple[List[str], float, float]]:
    """(units, measured / predicted forward, same for backward) per rank of replica 0, with the
    prediction recomputed from `profile` (the plan's own may come from another profile)."""
    here = _evaluate_plan(profile, plan, DEFAULT_BANDWIDTH, 0.0).stages
    out = []
    for r in report["stages"]:
        if r.get("replica", 0) != 0:
            continue
        stages = r.get("chunks", [r["rank"]])
        ratios = []
        for kind in ("forward_s", "backward_s"):
            planned = sum(float(getattr(plan.stages[g], kind)) for g in stages)
            # the report's prediction, rescaled from the plan's profile to this one
            predicted = float(r["predicted"][kind]) * (sum(getattr(here[g], kind) for g in stages) / planned) \
                if planned > 0 else 0.0
            ratios.append(float(r["measured"][kind]) / predicted if predicted > 0 else 1.0)
        out.append((list(r["units"]), ratios[0], ratios[1]))
    return out


def _scale_units(profile: Profile, runs: Sequence[Run]) -> Tuple[Profile, Dict[str, Any]]:
    samples: Dict[Tuple[str, int, str], List[float]] = {}  # (unit, size, kind) -> ratios
    # (size, 0 forward | 1 backward) -> one ratio per rank and run (a rank counts once, however
    # many units it runs: the stage's own cost is paid once per rank)
    by_size: Dict[Tuple[int, int], List[float]] = {}
    for plan, report in runs:
        b = plan.micro_batch_size
        for units, fwd, bwd in _rank_ratios(profile, plan, report):
            by_size.setdefault((b, 0), []).append(fwd)
            by_size.setdefault((b, 1), []).append(bwd)
            for name in units:
                samples.setdefault((name, b, "forward"), []).append(fwd)
                samples.setdefault((name, b, "backward"), []).append(bwd)
    calibrated = copy.deepcopy(profile)
    factors: Dict[str, Dict[str, Dict[str, float]]] = {}
    for unit in calibrated.units:
        for kind, times in (("forward", unit.forward_s), ("backward", unit.backward_s)):
            pooled = [x for (name, _, k), xs in samples.items() if name == unit.name and k == kind for x in xs]
            if not pooled:
                continue
            per_size = {}
            for b in list(times):
                measured = samples.get((unit.name, b, kind))
                per_size[b] = statistics.median(measured if measured else pooled)
                times[b] *= per_size[b]
                if kind == "backward" and unit.split_backward:  # its two parts are shares of it
                    unit.backward_input_s[b] *= per_size[b]
                    unit.backward_weight_s[b] *= per_size[b]
            factors.setdefault(unit.name, {})[kind] = {str(b): f for b, f in sorted(per_size.items())}
    # A stage's own cost (profile.stage_overhead: the call's and the engine's) is part of every rank's
    # compute: it takes the median of every rank's factor at its size (of all runs' at sizes no run
    # measured); the engine's share is folded into stage_overhead_s, so that both are scaled.
    # A split backward's own costs (split_overhead_s, weight_walk_s) take the backward's factor; the input parts
    # carry the engine's backward cost, as planner.cost.ranges charges it.
    overheads = {b: calibrated.stage_overhead(b) for b in calibrated.micro_batch_sizes}
    engine = calibrated.engine_overhead_s[1]
    calibrated.engine_overhead_s = (0.0, 0.0)
    for b, pair in overheads.items():
        split = calibrated.split_overhead_s.get(b)
        if pair == (0.0, 0.0) and split is None:
            continue
        factor = []
        for i in (0, 1):
            pooled = by_size.get((b, i)) or [x for (_, j), xs in by_size.items() if j == i for x in xs]
            factor.append(statistics.median(pooled) if pooled else 1.0)
        calibrated.stage_overhead_s[b] = (pair[0] * factor[0], pair[1] * factor[1])
        if split is not None:
            first_input, later_input, later_weight = split
            calibrated.split_overhead_s[b] = ((first_input + engine) * factor[1], (later_input + engine) * factor[1],
                                              later_weight * factor[1])
        if b in calibrated.weight_walk_s:
            calibrated.weight_walk_s[b] *= factor[1]
    return calibrated, factors


def _fit_latency(predicts: Sequence[Callable[[float], float]], measured: Sequence[float], base: float) -> float:
    """The smallest latency >= base at which the runs' mean predicted - measured reaches 0 (the
    prediction grows monotonically with latency: bisect); `base` when it already does."""
    def mean_residual(latency: float) -> float:
        return statistics.mean(p(latency) - t for p, t in zip(predicts, measured))

    if not predicts or mean_residual(base) >= 0:
        return base
    low, high = base, base + 1.0
    if mean_residual(high) < 0:
        return base
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if mean_residual(mid) < 0 else (low, mid)
    return low


def calibrate_profile(profile: Profile, runs: Sequence[Run]) -> Profile:
    """A copy of `profile` corrected by one round of runs [(plan, report), ...] (see the module)."""
    if not runs:
        raise ValueError("calibration needs at least one run (a report and the plan it executed)")
    for plan, report in runs:
        _check_run(profile, plan, report)
    calibrated, factors = _scale_units(profile, runs)
    calibration: Dict[str, Any] = dict(profile.extra.get("calibration") or {})
    calibration["unit_scale"] = factors
    # a flat ping-pong's bounding fit (runtime.worker) is no measurement of the link: left out
    links = [report["link"] for _, report in runs
             if (report.get("link") or {}).get("bandwidth_bytes_per_s") and not report["link"].get("flat")]
    if links:
        calibration["bandwidth_bytes_per_s"] = statistics.median(float(k["bandwidth_bytes_per_s"]) for k in links)
        calibration["latency_s"] = statistics.median(float(k.get("latency_s") or 0.0) for k in links)
        calibration["measured_links"] = [{"bandwidth_bytes_per_s": float(k["bandwidth_bytes_per_s"]),
                                          "latency_s": float(k.get("latency_s") or 0.0)} for k in links]
    first_plan = runs[0][0]
    bandwidth = float(calibration.get("bandwidth_bytes_per_s", first_plan.bandwidth_bytes_per_s or DEFAULT_BANDWIDTH))
    base_latency = float(calibration.get("latency_s", first_plan.latency_s or 0.0))

    def predictor(plan: Plan) -> Callable[[float], float]:
        return lambda latency: _evaluate_plan(calibrated, plan, bandwidth, latency).iteration_s

    measured = [float(report["measured_iteration_s"]) for _, report in runs]
    multi = [(predictor(plan), t) for (plan, _), t in zip(runs, measured) if len(plan.stages) > 1]
    latency = _fit_latency([p for p, _ in multi], [t for _, t in multi], base_latency)
    left = [t - predictor(plan)(latency) for (plan, _), t in zip(runs, measured)]
    calibration["bandwidth_bytes_per_s"] = bandwidth
    calibration["latency_s"] = latency
    calibration["step_overhead_s"] = max(0.0, statistics.median(left))
    calibration["runs"] = int(calibration.get("runs") or 0) + len(runs)
    calibrated.extra = dict(calibrated.extra, calibration=calibration)
    return calibrated


def factor_range(calibration: Dict[str, Any], kind: str) -> Tuple[float, float]:
    """(smallest, largest) scale factor of `kind` (forward | backward) over units and sizes."""
    values = [f for unit in calibration.get("unit_scale", {}).values() for f in unit.get(kind, {}).values()]
    return (min(values), max(values)) if values else (1.0, 1.0)


class LinkChoice(NamedTuple):
    bandwidth: float
    latency: float
    step_overhead_s: float
    note: Optional[str]
    message_s: float
    dp_bandwidth: Optional[float] = None  # the data-parallel all-reduce's rate; None: the link's bandwidth


def solve_link(profile: Profile, bandwidth: Optional[float] = None, latency: Optional[float] = None,
               message_s: Optional[float] = None, dp_bandwidth: Optional[float] = None) -> LinkChoice:
    """(bandwidth, latency, step overhead, note, per-message cost, all-reduce rate) a solve uses: the
    given values first (the user's --bandwidth/--latency/--message-cost/--dp-bandwidth), then the
    profile's calibration (profile.extra['calibration']), then the link `planner profile` measured
    (profile.extra['link'], its all-reduce rate in link.allreduce), then the defaults (5 GB/s, 0, 0,
    0; the all-reduce at the link's bandwidth). The note says what the profile supplied (None when
    it supplied nothing)."""
    calibration = profile.extra.get("calibration") or {}
    overhead = 0.0

    def fill(source: Dict[str, Any]) -> List[str]:
        """Take what is still unset from `source`; say what was taken."""
        nonlocal bandwidth, latency, message_s
        taken = []
        if message_s is None and source.get("message_s") is not None:
            message_s = float(source["message_s"])
            taken.append(f"{message_s * 1e6:.3g} us per message")
        if bandwidth is None and source.get("bandwidth_bytes_per_s"):
            bandwidth = float(source["bandwidth_bytes_per_s"])
            taken.append(f"bandwidth {bandwidth / 1e9:.3g} GB/s")
        if latency is None and source.get("latency_s") is not None:
            latency = float(source["latency_s"])
            taken.append(f"latency {latency * 1e6:.3g} us")
        return taken

    used = fill(calibration)
    link = profile.extra.get("link") or {}
    measured = fill(link)  # measured by `planner profile --link measure`
    if dp_bandwidth is None and (link.get("allreduce") or {}).get("bandwidth_bytes_per_s"):
        dp_bandwidth = float(link["allreduce"]["bandwidth_bytes_per_s"])
        measured.append(f"all-reduce {dp_bandwidth / 1e9:.3g} GB/s")
    if calibration.get("step_overhead_s"):
        overhead = max(0.0, float(calibration["step_overhead_s"]))
        used.append(f"step overhead {overhead * 1e3:.3g} ms")
    forward, backward = profile.engine_overhead_s  # in every stage's cost already (Profile.stage_overhead)
    engine = [f"charged the runtime engine's own cost: {forward * 1e6:.3g} us per forward, {backward * 1e6:.3g} us "
              "per backward"] if forward or backward else []
    notes = ([f"applied the profile's calibration: {', '.join(used)}"] if used else []) + \
        ([f"used the profile's measured link: {', '.join(measured)}"] if measured else []) + engine
    return LinkChoice(DEFAULT_BANDWIDTH if bandwidth is None else bandwidth, 0.0 if latency is None else latency,
                      overhead, "; ".join(notes) if notes else None, 0.0 if message_s is None else message_s,
                      dp_bandwidth)
