"""`planner solve PROFILE`: the plan (integer program by default), printed as a table and written as JSON."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from planner.cost.localsgd import DEFAULT_SYNC_OVERHEAD, local_sgd_refusal
from planner.errors import UsageError
from planner.jsonio import check_writable
from planner.pipeline.schedule import MAX_MICRO_BATCHES, MULTI_STAGE_SCHEDULES, ONE_STAGE_SCHEDULES, SCHEDULES
from planner.sizes import MAX_LATENCY_S, bandwidth_value, parse_bytes



LOCAL_SGD_MAX = 100_000  # steps between averages: beyond, a typo
DEFAULT_TIME_LIMIT_S = 60.0  # a search that would take minutes returns its best plan and gap instead


def add_problem_options(s: argparse.ArgumentParser) -> None:
    """The options describing the planning problem (shared by solve and compare)."""
    s.add_argument("profile", help="profile JSON from `planner profile` or `planner import-pipedream`")
    group = s.add_mutually_exclusive_group()
    group.add_argument("--stages", type=int, default=None, help="pipeline stages, one device each (default 2)")
    group.add_argument("--devices", type=int, default=None,
                       help="devices N: choose pipeline depth p and data-parallel degree d with p x d = N")
    s.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step, G = d x m x b (default: 2 x stages x largest profiled size)")
    s.add_argument("--memory-per-device", help="memory cap per device, e.g. 16GiB or 512MiB (default: none)")
    s.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES) + ["auto"],
                   help="pipeline schedule; auto lets the solver choose (default 1f1b)")
    s.add_argument("--virtual-stages", type=int, default=None,
                   help="stages per device for interleaved/bfs (default 2; --schedule auto compares 2, 3 and 4)")
    s.add_argument("--recompute", default="auto", choices=["auto", "none", "all"],
                   help="activation recomputation per unit: auto = where memory needs it (default auto)")
    s.add_argument("--bandwidth", default=None,
                   help="bytes/s between consecutive stages (default: the profile's calibration, else the link "
                        "planner profile measured, else 5GB)")
    s.add_argument("--dp-bandwidth", default=None, help="bytes/s each replica sends in the data-parallel all-reduce (default: the "
                        "profile's measured all-reduce, else --bandwidth)")
    s.add_argument("--latency", type=float, default=None,
                   help="seconds per message between stages (default: the profile's calibration, else the "
                        "measured link's, else 0)")
    s.add_argument("--message-cost", type=float, default=None,
                   help="seconds the runtime pays per message on each side, besides latency and transfer "
                        "(default: the profile's calibration, else the measured link's, else 0)")
    s.add_argument("--cluster", default=None, help="heterogeneous cluster JSON (see planner/cost/cluster.py)")
    s.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"],
                   help="optimizer whose state the memory model counts (default sgd)")
    s.add_argument("--precision", default=None, choices=["fp32", "bf16-mixed", "bf16"],
                   help="dtypes of parameters, gradients, optimizer state and compute (docs/memory.md; default: "
                        "bf16-mixed for a bfloat16/float16 profile, else fp32); runtime execute must run the same")
    s.add_argument("--shard", default="none", choices=["none", "optimizer", "gradients", "parameters", "auto"],
                   help="shard optimizer state / + gradients / + parameters across each stage's data-parallel "
                        "replicas (ZeRO-1/2/3); auto lets the solver choose (default none)")
    s.add_argument("--reserve", default=None,
                   help="bytes kept free on every device for what is not tensors (CUDA context, cuBLAS and NCCL "
                        "buffers), e.g. 2GiB, or 0 (default: 2.5GiB on GPUs and analytic GPU profiles, 0 on CPU; "
                        "docs/memory.md)")
    s.add_argument("--backend", default=None, choices=["highs", "cbc"],
                   help="MIP solver for --method ilp (default highs: faster in benchmarks/solver_speed.py; cbc, "
                        "with a note, where highspy cannot be imported)")
    s.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help=f"seconds: returns the best plan found with its gap (default {DEFAULT_TIME_LIMIT_S:.0f}; most "
                        "problems are proven optimal in well under a second); inf searches to the proof")
    s.add_argument("--quiet", action="store_true",
                   help="no progress lines (on a terminal the search says on stderr each time its best plan or "
                        "bound moves)")
    s.add_argument("--gap", type=float, default=None, metavar="FRACTION",
                   help="stop the exact search once no plan can be faster than the one found by more than this "
                        "share, e.g. 0.01 (default: proven optimal)")
    s.add_argument("--local-sgd-max", type=int, default=1, metavar="H",
                   help="let data-parallel replicas train alone and average their models every H steps, H <= "
                        "this bound (local SGD, for a slow data-parallel link; needs --devices and --shard none): "
                        "the smallest H whose averaging per step is within --sync-overhead of the step's compute, "
                        "else the bound (default 1: all-reduce gradients every step)")
    s.add_argument("--sync-overhead", type=float, default=DEFAULT_SYNC_OVERHEAD, metavar="FRACTION",
                   help="with --local-sgd-max: the share of the step's compute the averaging may add per step "
                        f"(default {DEFAULT_SYNC_OVERHEAD})")
    s.add_argument("--topology", default=None,
                   help="devices as levels (sites, hosts, devices) with their links, JSON (docs/solve.md): the "
                        "solver chooses p x d = its devices and where each replica's ranks run (--stages: only p)")


def problem_from_args(args: argparse.Namespace):
    """(profile, CostOptions, devices or None, candidate schedules, the --topology's DeviceTopology or
    None) from the parsed options."""
    from planner.cost.cluster import load_cluster
    from planner.cost.memory import default_precision
    from planner.cost.options import CostOptions
    from planner.profile.profile import load_profile

    if args.virtual_stages is not None and args.schedule not in (*MULTI_STAGE_SCHEDULES, "auto"):  # (was ignored)
        raise UsageError(f"--virtual-stages applies to interleaved and bfs, not --schedule {args.schedule}"
                         + (" (it runs 2 stages per device)" if args.schedule == "zb-v" else "") + "; drop it")
    if args.virtual_stages is None and args.schedule != "auto":  # under auto the search compares 2, 3 and 4
        args.virtual_stages = 2
    profile = load_profile(args.profile)
    cluster = None
    if args.cluster:
        try:
            cluster = load_cluster(args.cluster)
        except ValueError as e:
            raise UsageError(f"--cluster {args.cluster}: {e}") from None
    topology = load_topology_arg(args)
    if topology is not None and (cluster is not None or args.devices is not None):
        raise UsageError("--topology gives the devices (the solver chooses p x d and the placement); drop "
                         "--cluster/--devices")
    stages = args.stages if args.stages is not None else (cluster.num_devices if cluster else
                                                          topology.num_devices if topology else 2)
    if stages < 1 or (args.devices is not None and args.devices < 1):
        raise UsageError("--stages/--devices must be at least 1")
    if args.virtual_stages is not None and args.virtual_stages < 2:
        raise UsageError("--virtual-stages must be at least 2 (it only applies to interleaved and bfs)")
    width = args.devices if args.devices is not None else stages
    global_batch = max(profile.micro_batch_sizes) * width * 2 if args.global_batch is None else args.global_batch
    if global_batch < 1:
        raise UsageError("--global-batch must be positive")
    replicas_at_most = args.devices if args.devices is not None else 1  # --stages: one replica
    if global_batch > MAX_MICRO_BATCHES * max(profile.micro_batch_sizes) * replicas_at_most:
        raise UsageError(f"--global-batch {global_batch} is more than {MAX_MICRO_BATCHES} micro-batches per replica even at "
                         f"the largest profiled micro-batch size ({max(profile.micro_batch_sizes)}); profile larger "
                         "sizes (planner profile --micro-batch-sizes) or use more devices")
    for name, seconds in (("--latency", args.latency), ("--message-cost", args.message_cost)):
        if seconds is not None and not 0 <= seconds <= MAX_LATENCY_S:
            raise UsageError(f"{name} is seconds per message, 0 to {MAX_LATENCY_S:g} (got {seconds})")
    for name, size in (("--bandwidth", args.bandwidth), ("--dp-bandwidth", args.dp_bandwidth)):
        try:  # the rule a cluster or topology file's links are read by
            if size:
                bandwidth_value(size, name)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.schedule == "auto":
        schedules: List[str] = list(SCHEDULES)
    else:
        schedules = [args.schedule]
    from planner.fidelity.calibrate import solve_link

    bandwidth, latency, overhead, note, message_s, dp_bandwidth = solve_link(
        profile, parse_bytes(args.bandwidth, "--bandwidth") if args.bandwidth is not None else None, args.latency,
        args.message_cost, parse_bytes(args.dp_bandwidth, "--dp-bandwidth") if args.dp_bandwidth else None)
    args.calibration_note = note
    opts = CostOptions(
        pipeline_ranks=stages if args.devices is None else 1,
        global_batch=global_batch,
        schedule="1f1b",
        bandwidth=bandwidth,
        latency=latency,
        step_overhead_s=overhead,
        message_s=message_s,
        memory_cap=parse_bytes(args.memory_per_device, "--memory-per-device") if args.memory_per_device is not None
        else None,
        optimizer=args.optimizer,
        dp_bandwidth=dp_bandwidth,
        virtual_stages=args.virtual_stages if args.schedule in MULTI_STAGE_SCHEDULES else 1,
        cluster=cluster,
        recompute=args.recompute,
        precision=args.precision or profile.precision or default_precision(profile.dtype),
        shard=args.shard,
        reserve_bytes=_reserve_bytes(args.reserve),
    )
    if args.schedule in MULTI_STAGE_SCHEDULES:
        opts = opts.with_(schedule=args.schedule)
    if cluster is not None and args.devices is not None:
        raise UsageError("--cluster describes one pipeline; use --stages (its device count), not --devices")
    return profile, opts, args.devices, schedules, topology


def load_topology_arg(args: argparse.Namespace):
    """The --topology file (planner.cost.topology_file), checked; None without one."""
    from planner.cost.topology_file import load_topology

    path = getattr(args, "topology", None)
    if not path:
        return None
    try:
        return load_topology(path)
    except ValueError as e:
        raise UsageError(f"--topology {path}: {e}") from None


def _reserve_bytes(text: Optional[str]) -> Optional[float]:
    """--reserve: a size, or 0 for none; None: the profile's device default (planner.cost.memory)."""
    if text is None:
        return None
    return parse_bytes(text, "--reserve", least=0.0)


def ilp_backend(requested: Optional[str]) -> str:
    """The MIP solver the integer program runs on (planner.solve.backends.choose_backend); a
    fallback's one-line note goes to stderr."""
    from planner.solve.backends import choose_backend

    try:
        backend, note = choose_backend(requested)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if note:
        print(note, file=sys.stderr)
    return backend


def check_plan_flags(args: argparse.Namespace, opts, devices: Optional[int], topology) -> None:
    """--topology, --replicate and --local-sgd-max together: one-line refusals of what cannot be planned."""
    if topology is not None and getattr(args, "replicate", False):
        raise UsageError("--topology places whole stages on devices; drop --replicate")
    gap = getattr(args, "gap", None)
    if gap is not None:
        if not 0 <= gap < 1:
            raise UsageError(f"--gap is a share of the iteration time, at least 0 and below 1, e.g. 0.01 (got {gap})")
        if getattr(args, "method", "ilp") != "ilp":
            raise UsageError(f"--gap applies to --method ilp only; drop --gap or --method {args.method}")
    limit = getattr(args, "time_limit", None)
    if limit is not None and not 0 < limit <= float("inf"):
        raise UsageError(f"--time-limit is seconds, more than 0 (got {limit}); inf searches to the proof")
    if limit == float("inf"):
        args.time_limit = None
    _check_local_sgd(args, opts, devices, topology is not None)


def solve_problem(profile, opts, devices: Optional[int], schedules: List[str], topology, args: argparse.Namespace,
                  method: str, backend: Optional[str]):
    """The best plan by `method` (planner.solve.api.solve's) without replicated stages: over every
    placement on a --topology, with H chosen under --local-sgd-max, else over the scenarios of
    --devices/--schedule; InfeasibleError when none fits."""
    from planner.solve.api import solve
    from planner.solve.localsgd import solve_local_sgd
    from planner.solve.solution import OPTIMALITY_GAP

    gap = OPTIMALITY_GAP if getattr(args, "gap", None) is None else args.gap
    if topology is not None:
        from planner.solve.placed import solve_on_topology

        return solve_on_topology(profile, opts, topology, method=method, time_limit=args.time_limit, backend=backend,
                                 schedules=schedules, virtual_stages=args.virtual_stages, pipeline_ranks=args.stages,
                                 gap=gap)
    if args.local_sgd_max > 1:
        def run(options, scenario):  # scenario: on these options' own p, d, schedule and v
            return solve(profile, options, method=method, time_limit=args.time_limit, backend=backend, gap=gap,
                         devices=None if scenario else devices, schedules=[options.schedule] if scenario
                         else schedules, virtual_stages=options.virtual_stages if scenario else args.virtual_stages)

        return solve_local_sgd(profile, opts, args.local_sgd_max, args.sync_overhead, run)
    # on a terminal, a line each time the search moves its best plan or bound (a minute may pass silently else)
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) \
        if sys.stderr.isatty() and not getattr(args, "quiet", False) else None
    return solve(profile, opts, method=method, time_limit=args.time_limit, backend=backend, gap=gap,
                 devices=devices, schedules=schedules, virtual_stages=args.virtual_stages, progress=progress)


def cmd_solve(args: argparse.Namespace) -> int:
    from planner.plan.file import save_plan
    from planner.plan.make import make_plan
    from planner.cost.memory import parameter_view_refusal
    from planner.plan.runnable import plan_refusal
    from planner.plan.table import format_plan_table
    from planner.solve.diagnose import InfeasibleError, NoPlanInTime

    check_writable(args.output, [args.profile, args.cluster, args.topology])  # now, not after the search
    profile, opts, devices, schedules, topology = problem_from_args(args)
    if getattr(args, "calibration_note", None):
        print(args.calibration_note)
    if args.method == "ilp" and not args.replicate:
        args.backend = ilp_backend(args.backend)
    check_plan_flags(args, opts, devices, topology)
    if args.replicate and args.gap is not None:
        raise UsageError("--replicate has its own solver, which runs to its proof or --time-limit; drop --gap")
    try:
        if args.replicate:
            solution = solve_replicated_from_args(profile, opts, devices, schedules, args)
        else:
            solution = solve_problem(profile, opts, devices, schedules, topology, args, args.method, args.backend)
    except InfeasibleError as e:
        print(f"infeasible: {e}", file=sys.stderr)
        return 2
    except NoPlanInTime as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        raise UsageError(str(e)) from None
    plan = make_plan(profile, solution, opts, args.profile)
    save_plan(plan, args.output)
    print(format_plan_table(plan))
    note = _balanced_rhythm_note(profile, solution, opts, args)
    if note:
        print(note)
    refused = plan_refusal(plan)
    if refused is None and plan.shard == "parameters" and plan.data_parallel > 1:
        refused = parameter_view_refusal(profile.units)
    if refused:  # planned all the same: its memory and time hold for a runtime that runs it
        print(f"note: `runtime execute` does not run this plan: {refused}", file=sys.stderr)
    print(f"wrote {args.output}")
    return 0


def _balanced_rhythm_note(profile, solution, opts, args: argparse.Namespace) -> Optional[str]:
    """What the plan's step would be if every message cost what `planner profile` measured between
    two balanced stages' computations (link.rhythm, planner.profile.rhythm): an upper reading for a
    host where waiting on a message is slow, shown when it differs by 5 % or more. None without a
    rhythm, with a rhythm read into the charged per-message cost (link.rhythm.message_s: profiles
    measured since it is), with the user's own --latency, with one stage, or under a placement (whose levels have
    their own latencies)."""
    from planner.cost.model import evaluate

    rhythm = (profile.extra.get("link") or {}).get("rhythm")  # checked by the profile's loader
    scenario = solution.options or opts
    if rhythm is None or rhythm.get("message_s") is not None or args.latency is not None or scenario.num_stages < 2 or \
            rhythm["latency_s"] <= scenario.latency or scenario.placement is not None:
        return None
    latency = float(rhythm["latency_s"])
    slow = evaluate(profile, solution.boundaries, solution.micro_batch_size,
                    scenario.with_(latency=latency), solution.recompute).iteration_s
    if slow < 1.05 * solution.objective:
        return None
    return (f"on this host a message between two balanced stages' computations took {latency * 1e6:.0f} us "
            f"(planner profile's rhythm, not charged): if every message of this plan waited that long its step "
            f"would take {slow * 1e3:.3f} ms ({100 * (slow / solution.objective - 1):+.0f}%)")


def _check_local_sgd(args: argparse.Namespace, opts, devices: Optional[int], placed: bool) -> None:
    """--local-sgd-max and --sync-overhead: one-line refusals of what local SGD cannot plan."""
    h_max = args.local_sgd_max
    if not 1 <= h_max <= LOCAL_SGD_MAX:
        raise UsageError(f"--local-sgd-max is 1 to {LOCAL_SGD_MAX} steps (got {h_max}); 1 all-reduces gradients every "
                         "step")
    if not 0 < args.sync_overhead <= 10:
        raise UsageError(f"--sync-overhead must be a positive fraction of the step, at most 10 (got "
                         f"{args.sync_overhead}), e.g. 0.05")
    if h_max == 1:
        return
    refusal = local_sgd_refusal(h_max, opts.shard, bool(args.replicate), placed)
    if refusal:
        raise UsageError(refusal)
    if devices is None or devices < 2:
        give = "this problem has one: give --devices N" if devices is None else \
            f"--devices {devices} leaves one: give 2 or more"
        raise UsageError(f"--local-sgd-max {h_max} averages data-parallel replicas, and {give} (the solver chooses "
                         "p x d = N)")


def solve_replicated_from_args(profile, opts, devices: Optional[int], schedules: List[str], args: argparse.Namespace):
    """--replicate: N = --stages devices per data-parallel replica (or every p x d = --devices), shared
    by S <= N stages with r_g replicas each (planner.solve.replicas)."""
    from planner.solve.api import runnable_shardings
    from planner.solve.replicas import solve_replicated
    from planner.solve.search import expand_scenarios

    if getattr(args, "method", "ilp") != "ilp":
        raise UsageError("--replicate has its own solver; drop --method")
    if args.schedule not in ONE_STAGE_SCHEDULES + ("auto",):
        raise UsageError(f"--replicate needs --schedule 1f1b, gpipe or auto (got {args.schedule})")
    schedules = list(ONE_STAGE_SCHEDULES) if args.schedule == "auto" else [args.schedule]
    # (expand_scenarios also gives --shard auto its concrete shards: none alone where d = 1)
    scenarios = runnable_shardings(profile, opts, expand_scenarios(opts, 10 ** 9, devices, schedules), replicated=True)
    if not scenarios:
        raise UsageError(f"no data-parallel degree d divides both --devices {devices} and the global batch")
    return solve_replicated(profile, scenarios[0], scenarios, time_limit=getattr(args, "time_limit", None))


def register(sub) -> None:
    s = sub.add_parser("solve", help="choose stages, micro-batching, recomputation and schedule",
                       description="Assign contiguous units to pipeline stages and choose the micro-batch size, "
                                   "recomputation, data-parallel degree and schedule, minimising the modelled "
                                   "iteration time under each device's memory.")
    add_problem_options(s)
    s.add_argument("--method", default="ilp", choices=["ilp", "dp", "brute", "uniform", "params", "block"],
                   help="solver: ilp (default: the exact search, proven optimal or stopped with its gap), dp "
                        "(its fast starts and local search alone, with a lower bound), brute (tiny profiles), "
                        "or a baseline: uniform, params (DeepSpeed), block (torchgpipe)")
    s.add_argument("--replicate", action="store_true",
                   help="let heavy stages run on several devices (PipeDream-style replicas): --stages N is then "
                        "the devices per data-parallel replica, shared by at most N stages (1f1b or gpipe; "
                        "chosen on a closed form, timed by the simulation, with a busy-time bound as its gap)")
    s.add_argument("--output", "-o", default="plan.json", help="plan JSON to write (default plan.json)")
    s.set_defaults(func=cmd_solve)
