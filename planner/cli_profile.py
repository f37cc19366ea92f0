"""`planner profile MODEL`: capture and measure a model."""
from __future__ import annotations

import argparse
import os
import time

from planner.cli_common import parse_sizes


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



def register(sub) -> None:
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

