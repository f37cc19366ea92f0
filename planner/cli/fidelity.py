"""`planner simulate PLAN`, `planner check PLAN REPORT`, `planner calibrate PROFILE REPORT...`."""
from __future__ import annotations

import argparse
import sys

from planner.errors import UsageError
from planner.jsonio import check_writable, image_format


def cmd_simulate(args: argparse.Namespace) -> int:
    from planner.fidelity.simulation import format_simulation, simulate_plan
    from planner.plan.file import load_plan

    if args.timeline:  # before the work: a picture over the plan read lost it
        check_writable(args.timeline, [args.plan])
        image_format(args.timeline, "--timeline")
    plan = load_plan(args.plan)
    sim = simulate_plan(plan)
    print(format_simulation(sim))
    if args.timeline:
        from planner.fidelity.timeline import timeline_png

        timeline_png({}, sim.events, step=0, path=args.timeline)
        print(f"wrote {args.timeline}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from planner.fidelity.check import check_report, format_check, load_report, other_plan
    from planner.plan.file import load_plan

    plan = load_plan(args.plan)
    report = load_report(args.report)
    try:
        result = check_report(plan, report)
    except ValueError as e:
        raise UsageError(str(e)) from None
    warning = other_plan(plan, report)
    if warning:
        print(warning, file=sys.stderr)
    print(format_check(result))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from planner.fidelity.calibrate import calibrate_profile, factor_range
    from planner.fidelity.check import load_report, other_plan
    from planner.profile.profile import load_profile, save_profile
    from planner.plan.file import load_plan

    if len(args.plan) not in (1, len(args.reports)):
        raise UsageError(f"give one --plan for all reports or one per report ({len(args.reports)} reports, "
                         f"{len(args.plan)} plans), in the same order")
    check_writable(args.output, [args.profile, *args.reports, *args.plan])
    profile = load_profile(args.profile)
    plans = [load_plan(path) for path in args.plan]
    reports = [load_report(path) for path in args.reports]
    runs = list(zip(plans * len(reports) if len(plans) == 1 else plans, reports))
    try:
        calibrated = calibrate_profile(profile, runs)
    except ValueError as e:  # a report or plan of another model, units the profile lacks
        raise UsageError(f"{e}; calibrate a profile with reports of runs of the same model") from None
    for (plan, report), path in zip(runs, args.reports):  # after the refusals: an error stays one line
        warning = other_plan(plan, report)
        if warning:
            print(f"{path}: {warning}", file=sys.stderr)
    save_profile(calibrated, args.output)
    c = calibrated.extra["calibration"]
    (f_lo, f_hi), (b_lo, b_hi) = factor_range(c, "forward"), factor_range(c, "backward")
    print(f"scaled {len(c['unit_scale'])} units from {len(runs)} run(s): forward x{f_lo:.2f}..{f_hi:.2f}, "
          f"backward x{b_lo:.2f}..{b_hi:.2f}")
    if "bandwidth_bytes_per_s" in c:
        print(f"link: {c['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, latency {c['latency_s'] * 1e6:.0f} us")
    print(f"per-step overhead {c['step_overhead_s'] * 1e3:.2f} ms")
    print(f"wrote {args.output}; re-solve with it: planner solve {args.output} ...")
    return 0


def register(sub) -> None:
    s = sub.add_parser("simulate", help="discrete-event simulation of a plan's schedule",
                       description="Simulate every rank's instruction list with the plan's per-stage costs.")
    s.add_argument("plan")
    s.add_argument("--timeline", metavar="PNG", help="draw the simulated schedule")
    s.set_defaults(func=cmd_simulate)

    c = sub.add_parser("check", help="predicted vs measured, per rank and overall",
                       description="Compare a run's report (runtime execute --report) with its plan.")
    c.add_argument("plan")
    c.add_argument("report")
    c.set_defaults(func=cmd_check)

    k = sub.add_parser("calibrate", help="correct a profile from runs' reports",
                       description="Scale each unit's times by what its rank measured (the median over the "
                                   "runs, per micro-batch size), take the link's measured bandwidth and latency, "
                                   "and record the per-step overhead. Several runs (other splits, micro-batch "
                                   "sizes and counts) calibrate better than one: a shared host's noise averages out.")
    k.add_argument("profile")
    k.add_argument("reports", nargs="+", metavar="REPORT", help="runtime execute --report files")
    k.add_argument("--plan", required=True, action="append",
                   help="the plan a report's run executed: once for all reports, or once per report in order")
    k.add_argument("--output", "-o", required=True, help="calibrated profile to write")
    k.set_defaults(func=cmd_calibrate)
