"""`planner profile MODEL`: capture and measure a model."""
from __future__ import annotations

import argparse
import os
import time

from planner.cli_common import UsageError, parse_sizes


def _analytic(args: argparse.Namespace, model_args, sizes, progress):
    from planner.analytic import DeviceSpecError, load_device_spec
    from planner.analytic_profile import analytic_profile

    try:
        device = load_device_spec(args.device_spec or "h100", threads=args.threads)
    except DeviceSpecError as e:
        raise UsageError(str(e)) from None
    print(f"analytic profile of {args.model} {model_args or ''} for {device.name} at micro-batch sizes "
          f"{','.join(map(str, sizes))} (meta device, roofline)", flush=True)
    return analytic_profile(args.model, model_args, sizes, device, seed=args.seed, dtype=args.dtype,
                            progress=progress)


def cmd_profile(args: argparse.Namespace) -> int:
    from planner.measure import profile_model
    from planner.profile import save_profile
    from planner.spec import model_name, parse_model_args

    model_args = parse_model_args(args.model_arg or [])
    sizes = parse_sizes(args.micro_batch_sizes)
    output = args.output or os.path.join("profiles", f"{model_name(args.model)}.json")
    start = time.perf_counter()
    progress = (lambda msg: print(msg, flush=True)) if not args.quiet else None
    if args.device_spec and not args.analytic:
        raise UsageError("--device-spec is for analytic profiles: add --analytic")
    if args.analytic:
        profile = _analytic(args, model_args, sizes, progress)
    else:
        if args.dtype:
            raise UsageError("--dtype is for analytic profiles (measured ones use the model's own dtype)")
        print(f"profiling {args.model} {model_args or ''} on {args.device} at micro-batch sizes "
              f"{','.join(map(str, sizes))} ({args.threads} thread(s), median of {args.repeats} runs)", flush=True)
        profile = profile_model(args.model, model_args, sizes, device=args.device, seed=args.seed,
                                threads=args.threads, repeats=args.repeats, progress=progress)
    save_profile(profile, output)
    total_params = sum(u.param_bytes for u in profile.units)
    shared = profile.extra.get("shared_parameters") or []
    print(f"wrote {output}: {profile.num_units} units, {total_params / 2**20:.2f} MiB of parameters"
          f"{f' ({len(shared)} shared across units)' if shared else ''}, captured with {profile.capture}, "
          f"in {time.perf_counter() - start:.1f} s")
    return 0



def register(sub) -> None:
    p = sub.add_parser("profile", help="capture a model's graph and measure each partition unit",
                       description="Capture MODEL (torch.fx, else torch.export), split it into partition units and "
                                   "measure each one, or cost it analytically for a device not at hand. MODEL is "
                                   "builtin:NAME (gpt, resnet, mlp), hf:ClassName (Hugging Face transformers, random "
                                   "weights from the config; --model-arg overrides config fields, seq_len sets the "
                                   "sequence length) or package.module:function.")
    p.add_argument("model", help="builtin:NAME, hf:ClassName or package.module:function returning planner.ModelSpec")
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
    p.add_argument("--analytic", action="store_true", help="no measurement: build on the meta device, count FLOPs "
                   "and bytes per unit and convert them to times with --device-spec")
    p.add_argument("--device-spec", help="with --analytic: a100, h100 (default), h200 (profiles/devices/), "
                   "cpu-calibrated (measured here now) or a path to your own JSON spec")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="with --analytic: cast the model to this dtype first (e.g. bfloat16 for large models)")
    p.set_defaults(func=cmd_profile)

