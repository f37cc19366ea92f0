"""`planner solve PROFILE`: the integer program, and the plan file."""
from __future__ import annotations

import argparse
import sys

from planner.cli_common import UsageError, parse_bytes


def cmd_solve(args: argparse.Namespace) -> int:
    from planner.costmodel import CostOptions
    from planner.jsonio import write_json_atomic
    from planner.plan import format_plan_table, make_plan
    from planner.profile import load_profile
    from planner.solve import solve
    from planner.solve.diagnose import InfeasibleError

    profile = load_profile(args.profile)
    if args.stages < 1:
        raise UsageError("--stages must be at least 1")
    global_batch = max(profile.micro_batch_sizes) * args.stages * 2 if args.global_batch is None \
        else args.global_batch
    if global_batch < 1:
        raise UsageError("--global-batch must be positive")
    opts = CostOptions(
        num_stages=args.stages,
        global_batch=global_batch,
        schedule=args.schedule,
        bandwidth=parse_bytes(args.bandwidth, "--bandwidth"),
        latency=args.latency,
        memory_cap=parse_bytes(args.memory_per_device, "--memory-per-device") if args.memory_per_device else None,
        optimizer=args.optimizer,
    )
    try:
        solution = solve(profile, opts, method=args.method, time_limit=args.time_limit, backend=args.backend)
    except InfeasibleError as e:
        print(f"infeasible: {e}", file=sys.stderr)
        return 2
    plan = make_plan(profile, solution, opts, args.profile)
    write_json_atomic(args.output, plan)
    print(format_plan_table(plan))
    print(f"wrote {args.output}")
    return 0



def register(sub) -> None:
    s = sub.add_parser("solve", help="choose stages and micro-batching with an integer program",
                       description="Assign contiguous units to pipeline stages and choose the micro-batch size, "
                                   "minimising the modelled iteration time under each device's memory.")
    s.add_argument("profile", help="profile JSON from `planner profile`")
    s.add_argument("--stages", type=int, default=2, help="pipeline stages, one device each (default 2)")
    s.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default: 2 x stages x largest profiled micro-batch)")
    s.add_argument("--memory-per-device", help="memory cap per device, e.g. 16GiB or 512MiB (default: none)")
    s.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline schedule (default 1f1b)")
    s.add_argument("--bandwidth", default="5GB", help="bytes/s between consecutive stages (default 5GB)")
    s.add_argument("--latency", type=float, default=0.0, help="seconds per message between stages (default 0)")
    s.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"],
                   help="optimizer whose state the memory model counts (default sgd)")
    s.add_argument("--method", default="ilp", choices=["ilp", "brute"], help="solver (default ilp)")
    s.add_argument("--backend", default="cbc", choices=["cbc", "highs"], help="MIP solver for --method ilp")
    s.add_argument("--time-limit", type=float, default=None, help="seconds; returns the best plan with its gap")
    s.add_argument("--output", "-o", default="plan.json", help="plan JSON to write (default plan.json)")
    s.set_defaults(func=cmd_solve)
