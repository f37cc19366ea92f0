"""`planner profile MODEL`: capture and measure a model."""
from __future__ import annotations

import argparse
import os
import sys
import time

from planner.cli.common import parse_sizes
from planner.errors import UsageError
from planner.jsonio import check_writable
from planner.profile.profile import PROFILE_PRECISIONS


def _analytic(args: argparse.Namespace, model_args, sizes, progress):
    from planner.profile.analytic import DeviceSpecError, load_device_spec
    from planner.profile.analytic_profile import analytic_profile

    try:
        device = load_device_spec(args.device_spec or "h100", threads=args.threads)
    except DeviceSpecError as e:
        raise UsageError(str(e)) from None
    print(f"analytic profile of {args.model} {model_args or ''} for {device.name} at micro-batch sizes "
          f"{','.join(map(str, sizes))} (meta device, roofline)", flush=True)
    return analytic_profile(args.model, model_args, sizes, device, seed=args.seed, dtype=args.dtype,
                            progress=progress, attention=args.attention or "flash")


def _measuring(choice, args: argparse.Namespace) -> bool:
    """--link / --engine-cost: measure, or not; by default on the CPU only."""
    return (choice or ("measure" if args.device == "cpu" else "none")) == "measure"


def _link(args: argparse.Namespace, profile, sizes) -> None:
    """--link measure: ping-pong between two local processes at the profile's cut sizes, through the
    transport `runtime execute --p2p` gives them (shared memory, or gloo with --p2p gloo)."""
    if not _measuring(args.link, args):
        return
    if args.device != "cpu":
        raise UsageError("--link measure times two processes on this host (CPU runs); for GPUs "
                         "give planner solve --bandwidth/--latency or calibrate from a run")
    from planner.profile.link import measure_link
    from planner.profile.rhythm import rhythm_compute

    cut_bytes = sorted({c.activation_bytes(b) for c in profile.cuts for b in sizes} - {0})
    link = measure_link(cut_bytes, threads=args.threads, rhythm=rhythm_compute(profile), p2p=args.p2p)
    profile.extra["link"] = link
    if link.get("warning"):
        print("warning: " + link["warning"], file=sys.stderr, flush=True)
    print(f"link ({link['p2p']}, two processes on this host): latency {link['latency_s'] * 1e6:.0f} us "
          f"({_rhythm_note(link)}), "
          f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s ({len(link['samples'])} message sizes, median of "
          f"{link['repeats']} round trips), {_message_note(link)}, all-reduce "
          f"{link['allreduce']['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s per replica ({link['allreduce']['transport']}); planner solve uses them unless "
          "--bandwidth/--latency/--message-cost/--dp-bandwidth are given", flush=True)


def _engine_cost(args: argparse.Namespace, profile) -> None:
    """--engine-cost measure: what the runtime's engine adds per micro-batch to every stage's compute,
    timed in a two-stage pipeline of a small model (runtime.engine_probe, in a process of its own)."""
    if not _measuring(args.engine_cost, args):
        return
    from planner.profile.engine_cost import measure_engine_overhead

    try:
        profile.engine_overhead_s = measure_engine_overhead(args.threads)
    except RuntimeError as e:  # the profile stands without it: say so, charge none
        print(f"warning: {e}; planner solve charges no engine cost (--engine-cost none skips measuring it)",
              file=sys.stderr, flush=True)
        return
    forward, backward = profile.engine_overhead_s
    print(f"engine: {forward * 1e6:.0f} us per forward, {backward * 1e6:.0f} us per backward of the runtime's own "
          "work (two stages of a small model run by the engine, each action less its compute); planner solve adds "
          "them to every stage's micro-batch", flush=True)


def _rhythm_note(link) -> str:
    rhythm = link.get("rhythm")
    if not rhythm:
        return "back to back"
    return (f"back to back; {rhythm['latency_s'] * 1e6:.0f} us between two balanced stages' computations of "
            f"{(rhythm['forward_s'] + rhythm['backward_s']) * 1e3:.1f} ms, not charged")


def _message_note(link) -> str:
    """What a plan charges per message operation and where it was read."""
    charged = f"{link['message_s'] * 1e6:.1f} us per message operation"
    if (link.get("rhythm") or {}).get("message_s") is None:
        return charged + " in a batch"
    return (charged + f" between computations, through the engine (back to back in a batch "
            f"{link.get('transport_message_s', 0.0) * 1e6:.1f} us)")


def _cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _check_measure_options(args: argparse.Namespace) -> None:
    """The options of a measured profile, checked before torch is loaded (a typo fails at once)."""
    if args.dtype:
        raise UsageError("--dtype is for analytic profiles (measured ones use the model's own dtype; "
                         "--precision bf16-mixed measures them as a bf16-mixed run)")
    if args.ranks_per_host < 1:
        raise UsageError("--ranks-per-host must be at least 1")
    if args.ranks_per_host > 1 and args.device != "cpu":
        raise UsageError("--ranks-per-host > 1 models ranks sharing a CPU host; it applies to --device cpu only")
    cores = _cores()
    if args.ranks_per_host > cores:  # each rank but one is a co-runner process, busy on a core of its own
        raise UsageError(f"--ranks-per-host {args.ranks_per_host} is more than the {cores} core(s) this process may "
                         f"use; profile on the host the ranks will share, with at most one rank per core")
    if not (0 <= args.warmup <= 3600 and 0 <= args.min_time <= 3600):
        raise UsageError("--warmup and --min-time are seconds, 0 to 3600")
    if not 0 <= args.threads <= cores:
        raise UsageError(f"--threads is torch threads while measuring, 0 (torch's default) to the {cores} "
                         "core(s) this process may use")
    if args.retries < 0:
        raise UsageError("--retries must be 0 or more")
    if args.repeats < 1:  # (a profile recording -3 was refused by planner solve)
        raise UsageError(f"--repeats is timed runs per unit, at least 1 (got {args.repeats})")
    if not 0 <= args.seed < 2 ** 63:
        raise UsageError(f"--seed is an integer 0 to 2**63 - 1 (got {args.seed})")
    if args.engine_cost == "measure" and args.device != "cpu":
        raise UsageError("--engine-cost measure times the engine on the CPU; on CUDA a stage's host work overlaps "
                         "its kernels: leave it out, or calibrate from a run")


def cmd_profile(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.micro_batch_sizes)
    if args.attention and not args.analytic:
        raise UsageError("--attention is for analytic profiles (measured ones run the model's own attention; "
                         "Hugging Face models: --model-arg attn_implementation=eager|sdpa)")
    if args.device_spec and not args.analytic:
        raise UsageError("--device-spec is for analytic profiles: add --analytic")
    if args.precision != "fp32" and args.analytic:
        raise UsageError("--precision is for measured profiles (an analytic one casts the model: --dtype)")
    if args.engine_cost == "measure" and args.analytic:
        raise UsageError("--engine-cost measure times this runtime's engine on this CPU; an analytic profile has none")
    if args.link == "measure" and args.analytic:  # (it was ignored: the profile had no link)
        raise UsageError("--link measure times messages between two processes of this host; an analytic profile "
                         "measures nothing: give planner solve --bandwidth/--latency, or leave --analytic out")
    if args.ranks_per_host != 1 and args.analytic:
        raise UsageError("--ranks-per-host loads the other cores while measuring; an analytic profile measures "
                         "nothing: leave it out, or leave --analytic out")
    if not args.analytic:
        _check_measure_options(args)
    from planner.profile.hostspeed import steadiest_profile
    from planner.profile.measure import profile_model
    from planner.profile.profile import save_profile
    from planner.model.entry import model_name, parse_model_args

    model_args = parse_model_args(args.model_arg or [])
    output = args.output or os.path.join("profiles", f"{model_name(args.model)}.json")
    check_writable(output, [args.device_spec])  # now, not after the measurements
    start = time.perf_counter()
    progress = (lambda msg: print(msg, flush=True)) if not args.quiet else None
    if args.analytic:
        profile = _analytic(args, model_args, sizes, progress)
    else:
        shared = f", {args.ranks_per_host - 1} co-runner(s) loading the other cores" if args.ranks_per_host > 1 else ""
        mixed = " under bf16-mixed (autocast, bf16 weight copies)" if args.precision == "bf16-mixed" else ""
        named = f"{args.model} {model_args}" if model_args else args.model
        print(f"profiling {named} on {args.device}{mixed} at micro-batch sizes "
              f"{','.join(map(str, sizes))} ({args.threads} thread(s), median of at least {args.repeats} runs and "
              f"{args.min_time:g} s per size after {args.warmup:g} s warm-up{shared})", flush=True)
        profile = steadiest_profile(lambda: profile_model(
            args.model, model_args, sizes, device=args.device, seed=args.seed, threads=args.threads,
            repeats=args.repeats, progress=progress, warmup_s=args.warmup, min_time_s=args.min_time,
            co_runners=args.ranks_per_host - 1, precision=args.precision,
            flush_subnormals=not args.keep_subnormals), args.retries,
            lambda msg: print(msg, flush=True))
        _link(args, profile, sizes)
        _engine_cost(args, profile)
    save_profile(profile, output)
    total_params = sum(u.param_bytes for u in profile.units)
    trainable = sum(u.trainable_bytes for u in profile.units)
    frozen = f" ({trainable / 2**20:.2f} MiB trainable, the rest frozen)" if trainable < total_params else ""
    shared = profile.extra.get("shared_parameters") or []
    print(f"wrote {output}: {profile.num_units} units, {total_params / 2**20:.2f} MiB of parameters{frozen}"
          f"{f' ({len(shared)} shared across units)' if shared else ''}, captured with {profile.capture}, "
          f"in {time.perf_counter() - start:.1f} s")
    return 0



def register(sub) -> None:
    p = sub.add_parser("profile", help="capture a model's graph and measure each partition unit",
                       description="Capture MODEL (torch.fx, else torch.export), split it into partition units and "
                                   "measure each one, or cost it analytically for a device not at hand. MODEL is "
                                   "builtin:NAME (gpt, resnet, mobilenet, unet, mlp), hf:ClassName (Hugging Face "
                                   "transformers, random weights from the config; --model-arg overrides config "
                                   "fields, seq_len sets the sequence length) or package.module:function.")
    p.add_argument("model", help="builtin:NAME, hf:ClassName or package.module:function returning planner.ModelSpec")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="argument for the model function "
                   "(repeatable; int/float/bool literals, else strings)")
    p.add_argument("--micro-batch-sizes", default="1,2,4", help="micro-batch sizes to measure (default 1,2,4)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device to measure on (default cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads while measuring; match the threads each rank will have (default 1)")
    p.add_argument("--keep-subnormals", action="store_true",
                   help="time (and have the plan's ranks compute) on subnormal floats; by default both flush them to "
                        "zero on the CPU, so a unit's time does not depend on the weights' values (docs/fidelity.md)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per unit, after warm-up (median; default 7)")
    p.add_argument("--warmup", type=float, default=0.5,
                   help="seconds of untimed warm-up rounds over all units first (default 0.5)")
    p.add_argument("--min-time", type=float, default=1.0,
                   help="timed seconds per micro-batch size at least: units are timed round-robin until both "
                        "--repeats rounds and this much time are done (default 1.0; 0: --repeats rounds only)")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks the runs will put on this CPU host: N - 1 co-runner processes run the model's training "
                        "step on the other cores while measuring, as those ranks contend for caches and memory "
                        "bandwidth (default 1: measure alone)")
    p.add_argument("--retries", type=int, default=2,
                   help="profile again, at most this many times, when the host's speed (a reference kernel timed "
                        "before and after) drifted by more than 10 %% while measuring; keeps the steadiest attempt "
                        "(CPU; default 2)")
    p.add_argument("--link", choices=["measure", "none"], default=None,
                   help="measure: time messages between two processes on this host at the cut sizes and "
                        "record latency and bandwidth in the profile, which planner solve then uses by default "
                        "(default on CPU; none on CUDA)")
    p.add_argument("--p2p", choices=["auto", "gloo"], default="auto",
                   help="the transport --link measure times, as `runtime execute --p2p` will use it: auto (default), "
                        "shared memory between processes of this host; gloo: gloo over loopback")
    p.add_argument("--engine-cost", choices=["measure", "none"], default=None,
                   help="measure: time what `runtime execute`'s engine adds per forward and backward (its own "
                        "work, in a two-stage pipeline of a small model, about 5 s) and record it, which planner "
                        "solve adds to every stage (default on CPU; none on CUDA)")
    p.add_argument("--precision", choices=PROFILE_PRECISIONS, default="fp32",
                   help="bf16-mixed: run every unit as `runtime execute --precision bf16-mixed` runs it (autocast "
                        "bf16, the bf16 weight copies) while measuring: saved, output and cut bytes are such a "
                        "run's (what autocast keeps in fp32 too), times are under autocast on this device; plan "
                        "it at --precision bf16-mixed (the default for such a profile). fp32 (default): the model "
                        "as built; a bf16-mixed plan of it scales its bytes")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model (default 0)")
    p.add_argument("--output", "-o", help="profile JSON to write (default profiles/<model>.json)")
    p.add_argument("--quiet", action="store_true", help="no per-unit progress lines")
    p.add_argument("--analytic", action="store_true", help="no measurement: build on the meta device, count FLOPs "
                   "and bytes per unit and convert them to times with --device-spec")
    p.add_argument("--device-spec", help="with --analytic: a100, h100 (default), h200 (profiles/devices/), "
                   "cpu-calibrated (measured here now) or a path to your own JSON spec")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="with --analytic: cast the model to this dtype first (e.g. bfloat16 for large models)")
    p.add_argument("--attention", choices=["flash", "as-built"],
                   help="with --analytic: cost scaled_dot_product_attention as the memory-efficient kernel GPUs run "
                        "(flash, default: no S x S tensor saved) or as the meta device runs the model's code "
                        "(as-built); Hugging Face models call it unless built with attn_implementation=eager")
    p.set_defaults(func=cmd_profile)

