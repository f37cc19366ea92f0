"""`planner profile MODEL` and `planner solve PROFILE`."""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import List, Optional

from planner.jsonio import JsonFileError

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class UsageError(ValueError):
    """A bad option value; the message says what is expected."""


def parse_bytes(text: str, option: str = "size") -> float:
    """'16GiB' -> 17179869184; '512MiB', '1.5GB', '1e9' and plain byte counts work too."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(f"{option} {text!r} is not a size; write e.g. 16GiB, 512MiB, 2GB or a byte count")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UsageError(f"{option} must be positive (got {text!r})")
    return value


def parse_sizes(text: str) -> List[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise UsageError(f"--micro-batch-sizes {text!r} must be comma-separated integers, e.g. 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise UsageError("--micro-batch-sizes needs positive integers, e.g. 1,2,4")
    return sizes


# --- planner profile ----------------------------------------------------------------------
def cmd_profile(args: argparse.Namespace) -> int:
    from planner.measure import profile_model
    from planner.profile import save_profile
    from planner.spec import model_name, parse_model_args

    model_args = parse_model_args(args.model_arg or [])
    sizes = parse_sizes(args.micro_batch_sizes)
    output = args.output or os.path.join("profiles", f"{model_name(args.model)}.json")
    start = time.perf_counter()
    print(f"profiling {args.model} {model_args or ''} on {args.device} at micro-batch sizes "
          f"{','.join(map(str, sizes))} ({args.threads} thread(s), median of {args.repeats} runs)", flush=True)
    profile = profile_model(args.model, model_args, sizes, device=args.device, seed=args.seed,
                            threads=args.threads, repeats=args.repeats,
                            progress=lambda msg: print(msg, flush=True) if not args.quiet else None)
    save_profile(profile, output)
    total_params = sum(u.param_bytes for u in profile.units)
    print(f"wrote {output}: {profile.num_units} units, {total_params / 2**20:.2f} MiB of parameters, "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


# --- planner solve ------------------------------------------------------------------------
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planner", description="Plan pipeline-parallel training of a PyTorch model.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="capture a model's graph and measure each partition unit",
                       description="Capture MODEL with torch.fx, split it into partition units and measure each "
                                   "one. MODEL is builtin:NAME (gpt, resnet, mlp) or package.module:function.")
    p.add_argument("model", help="builtin:NAME or package.module:function returning planner.ModelSpec")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="argument for the model function "
                   "(repeatable; int/float/bool literals, else strings)")
    p.add_argument("--micro-batch-sizes", default="1,2,4", help="micro-batch sizes to measure (default 1,2,4)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device to measure on (default cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads while measuring; match the threads each rank will have (default 1)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per unit, after warm-up (median; default 7)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model (default 0)")
    p.add_argument("--output", "-o", help="profile JSON to write (default profiles/<model>.json)")
    p.add_argument("--quiet", action="store_true", help="no per-unit progress lines")
    p.set_defaults(func=cmd_profile)

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
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from planner.capture import CaptureError
    from planner.spec import ModelEntryError

    try:
        return args.func(args)
    except (UsageError, JsonFileError, ModelEntryError, CaptureError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
