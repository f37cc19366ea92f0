"""Fidelity grid: predicted vs measured iteration time on real runs, before and after one
calibration round.

    .venv/bin/python benchmarks/fidelity.py [--passes 5] [--steps 10] [--json out.json]
    .venv/bin/python benchmarks/fidelity.py --device cuda --passes 3     # the same grid on GPUs (one per stage)
    .venv/bin/python benchmarks/fidelity.py --models mlp,mobilenet --stages 2 --micro-batches 8,16 --sizes 1,2
                                          # small micro-batches, on models held out from the model's development
    .venv/bin/python benchmarks/fidelity.py --schedule zb-h1 --stages 2 --models mlp,gpt
                                          # the same grid under a zero-bubble schedule (default 1f1b)
    .venv/bin/python benchmarks/fidelity.py --stages 2 --schedule 1f1b,interleaved,zb-v \
        --model hf:BertForMaskedLM --model-arg hidden_size=64 --model-arg num_hidden_layers=4 --models builtin:unet
                                          # any model spec (each --model with its own --model-args) under
                                          # several schedules (interleaved and bfs: --virtual-stages per rank)

By default built-in gpt and resnet x stages {1, 2} x micro-batches {2, 4, 8} x micro-batch sizes {2, 4}:
profile (afresh before each pass over the grid: a shared machine drifts over minutes) the way the
ranks of that stage count run (1 thread each; round-robin over units after a
warm-up, at least 1 s timed per size; for 2 stages with one co-runner process on the other core,
as `planner profile --ranks-per-host 2`), measure the gloo link between two local processes at the
cut sizes (`--link measure`), solve the split with the ILP for that (b, m) with that link, run it
with `runtime execute`, and compare the plan's predicted iteration time (the simulation of its lists)
with the measured one: the median over `--passes` whole
passes over the grid of each run's median steady step. Each run also records how many cores
other processes kept busy meanwhile, and how fast the host computed against the profile
(planner.profile.hostspeed: a reference kernel every rank times before and after its steps): a run off
the profile's speed by more than 10 % (a shared host's slow spell) is run again, at most twice,
keeping the try nearest the profile's speed; a profile whose host speed drifted that much while
it was measured is measured again (at most twice, keeping the steadiest). The error of the first tries alone is reported beside it.
Then one calibration round per model and stage count: each pass's profile is calibrated from
the runs at the middle m and the two smallest b (default (4, 2), (4, 4)) of every pass (`planner calibrate`)
and predicts that stage count's grid points again, median over passes as before: the mean
absolute percentage error (MAPE) before and after.
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# ranks started as this process's own children, so that its CPU accounting (RUSAGE_CHILDREN) counts
# them and "other processes" means other jobs (forked from runtime.launch's fork server they would not be)
os.environ.setdefault("PIPEPLANNER_LAUNCH", "subprocess")
from common import run_plan  # noqa: E402
from fidelity_grid import (DEFAULT_MODELS, MODELS, add_grid_options, grid_models, grid_schedules,  # noqa: E402,F401
                           rank_lines, virtual_stages_of)

from planner.cost.model import evaluate  # noqa: E402
from planner.cost.options import CostOptions  # noqa: E402
from planner.fidelity.calibrate import calibrate_profile, solve_link  # noqa: E402
from planner.fidelity.simulation import replay_s, simulate_plan  # noqa: E402
from planner.jsonio import write_json_atomic  # noqa: E402
from planner.plan.make import make_plan  # noqa: E402
from planner.profile.hostspeed import SLOWDOWN_WARN, at_host_speed, worst_ratio  # noqa: E402
from planner.profile.link import measure_link  # noqa: E402
from planner.profile.hostspeed import steadiest_profile  # noqa: E402
from planner.profile.measure import profile_model  # noqa: E402
from planner.profile.engine_cost import measure_engine_overhead  # noqa: E402
from planner.profile.rhythm import rhythm_compute  # noqa: E402
from planner.solve.api import solve  # noqa: E402

STAGES = (1, 2)
MICRO_BATCHES = (2, 4, 8)
SIZES = (2, 4)
# The runs one calibration round takes, per model and stage count: these (m, b) points of every pass.
CALIBRATION_POINTS = ((4, 2), (4, 4))
# A run (or a profile) that met another host speed than its profile (or than itself, before and
# after) by more than planner.profile.hostspeed.SLOWDOWN_WARN is measured again, at most this many times.
RETRIES = 2


def only_size(profile, b):
    """The profile restricted to one micro-batch size, so the solver keeps (b, m) fixed."""
    p = copy.deepcopy(profile)
    p.micro_batch_sizes = [b]
    return p


def plan_for(profile, stages, m, b, opts_extra=None, schedule="1f1b", virtual_stages=1):
    opts = CostOptions(pipeline_ranks=stages, global_batch=m * b, schedule=schedule, virtual_stages=virtual_stages,
                       **(opts_extra or {}))
    solution = solve(only_size(profile, b), opts, method="ilp")
    return make_plan(profile, solution, opts, "benchmark"), opts


def plan_fixed(profile, plan, opts_extra=None):
    """`plan`'s split and (b, m), re-planned (costs, predictions) from another profile."""
    from planner.solve.solution import Solution

    b, m = plan.micro_batch_size, plan.num_micro_batches
    boundaries = [s.first_unit for s in plan.stages[1:]]
    opts = CostOptions(pipeline_ranks=plan.pipeline_stages, global_batch=m * b, schedule=plan.schedule,
                       virtual_stages=plan.virtual_stages, **(opts_extra or {}))
    cost = evaluate(only_size(profile, b), boundaries, b, opts)
    solution = Solution(boundaries=boundaries, micro_batch_size=b, num_micro_batches=m, cost=cost, status="fixed",
                        objective=cost.iteration_s, bound=cost.iteration_s, gap=0.0, seconds=0.0, method="fixed",
                        backend="none")
    return make_plan(profile, solution, opts, "benchmark")


def link_options(profile):
    """What `planner solve` takes from the profile by default, as cost-model options: its
    calibration, else the measured link (planner profile --link measure) with its per-message cost."""
    bandwidth, latency, overhead, _, message_s, dp_bandwidth = solve_link(profile)
    return {"bandwidth": bandwidth, "latency": latency, "step_overhead_s": overhead, "message_s": message_s,
            "dp_bandwidth": dp_bandwidth}


def _busy_cpu_s():
    """System-wide busy CPU seconds so far (/proc/stat), None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s():
    self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime


def measured_run(plan, steps):
    """(report, other_cores): run the plan, and how many cores other processes kept busy meanwhile
    on average (the machine is shared; a run disturbed by other jobs shows it here)."""
    busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.perf_counter()
    report = run_plan(plan, steps)
    busy1, own1, wall = _busy_cpu_s(), _own_cpu_s(), time.perf_counter() - t0
    other = None if busy0 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return report, other


def host_off(report) -> float:
    """How far the run's host speed was from the profile's: the largest |ratio - 1| over ranks."""
    return abs(worst_ratio(report.get("host_slowdown")) - 1.0)


def mape(rows, key, measured="measured_s"):
    return statistics.mean(abs(r[key] - r[measured]) / r[measured] for r in rows) * 100


def profiles_for(entry, model_args, args):
    """One profile per stage count: measured as its ranks will run (S - 1 co-runners), with the
    link; profiled again (at most RETRIES times) when the host's speed changed while profiling."""
    profiles = {}
    for stages in args.stage_counts:
        profiles[stages] = steadiest_profile(lambda: profile_model(
            entry, model_args, list(args.size_list), device=args.device, threads=1, repeats=7, warmup_s=args.warmup,
            min_time_s=args.min_time, co_runners=stages - 1 if args.co_runners else 0), args.retries,
            lambda msg: print(f"  profile for {stages} stage(s): {msg}", flush=True))
    if args.link:
        cut_bytes = {c.activation_bytes(b) for c in profiles[min(profiles)].cuts for b in args.size_list}
        two = profiles.get(2) or profiles[max(profiles)]
        link = measure_link(sorted(cut_bytes), rhythm=rhythm_compute(two))
        for prof in profiles.values():
            prof.extra["link"] = link
    if args.engine_cost and args.device == "cpu":  # as `planner profile` measures it (runtime.engine_probe)
        engine = measure_engine_overhead(threads=1)
        for prof in profiles.values():
            prof.engine_overhead_s = engine
    return profiles


def run_point(plan, profile, steps, retries=RETRIES):
    """One grid point of one pass: run it; run again (at most RETRIES times) while the run's host
    speed is off the profile's by more than SLOWDOWN_WARN, keeping the try closest to the profile's
    speed. The first try is kept beside it (the error without re-measurement)."""
    tries = []
    for _ in range(retries + 1):
        report, other = measured_run(plan, steps)
        tries.append({"measured_s": report["measured_iteration_s"], "other": other, "report": report,
                      "host_off": host_off(report)})
        if tries[-1]["host_off"] <= SLOWDOWN_WARN:
            break
    best = min(tries, key=lambda t: t["host_off"])
    predicted = plan.predicted_iteration_s
    scaled = at_host_speed(predicted, best["report"].get("host_slowdown"))
    return dict(best, plan=plan, profile=profile, predicted_s=predicted,
                at_host_speed_s=predicted if scaled is None else scaled,
                simulated_s=simulate_plan(plan).iteration_s, first_measured_s=tries[0]["measured_s"],
                replayed_s=replay_s(plan, best["report"]),
                tries=len(tries), host_off_tries=[t["host_off"] for t in tries])


def run_passes(name, args):
    """Every pass over the grid for one model, every schedule: {(schedule, S, m, b): plan},
    {(schedule, S, m, b): [run per pass]}."""
    entry, model_args = args.model_table[name]
    plans, runs = None, None
    for rep in range(args.passes):
        # Whole passes over the grid, each profiled afresh just before its runs: the machine's speed
        # drifts over minutes (shared host), and the prediction should see the same spell the runs do.
        profiles = profiles_for(entry, model_args, args)
        link = profiles[min(profiles)].extra.get("link")
        if link:
            print(f"{name} pass {rep + 1}: link {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
                  f"latency {link['latency_s'] * 1e6:.0f} us", flush=True)
        if plans is None:  # the splits are solved once (first pass) and kept, so each point is one plan
            plans = {(schedule, stages, m, b): plan_for(profiles[stages], stages, m, b, link_options(profiles[stages]),
                                                        schedule, virtual_stages_of(schedule, args.virtual_stages))[0]
                     for schedule in args.schedule_list for stages in args.stage_counts
                     for m in args.m_list for b in args.size_list}
            runs = {key: [] for key in plans}
        for key, plan in plans.items():
            profile = profiles[key[1]]
            run = run_point(plan_fixed(profile, plan, link_options(profile)), profile, args.steps, args.retries)
            runs[key].append(run)
            print(f"{name:6} pass {rep + 1} {key[0]} S={key[1]} m={key[2]} b={key[3]}: predicted "
                  f"{run['predicted_s'] * 1e3:7.2f} ms, measured {run['measured_s'] * 1e3:7.2f} ms, host speed off "
                  f"{', '.join(f'{h * 100:.0f}' for h in run['host_off_tries'])} %"
                  + (f" (other processes: {run['other']:.2f} cores)" if run["other"] is not None else ""), flush=True)
    return plans, runs


def grid_rows(name, plans, runs, schedule="1f1b"):
    rows = []
    for (stages, m, b), plan in plans.items():
        done = runs[(stages, m, b)]
        others = [r["other"] for r in done if r["other"] is not None]
        rows.append({"model": name, "schedule": schedule, "stages": stages, "m": m, "b": b,
                     "split": [s.units[0] for s in plan.stages],
                     "predicted_s": statistics.median(r["predicted_s"] for r in done),
                     "simulated_s": statistics.median(r["simulated_s"] for r in done),
                     "at_host_speed_s": statistics.median(r["at_host_speed_s"] for r in done),
                     "replayed_s": statistics.median(r["replayed_s"] for r in done),
                     "measured_s": statistics.median(r["measured_s"] for r in done),
                     "first_measured_s": statistics.median(r["first_measured_s"] for r in done),
                     "predicted_runs_s": [r["predicted_s"] for r in done],
                     "measured_runs_s": [r["measured_s"] for r in done],
                     "tries": [r["tries"] for r in done],
                     "ranks_runs": [rank_lines(r["report"]) for r in done],
                     "host_ratio_runs": [worst_ratio(r["report"].get("host_slowdown")) for r in done],
                     "other_cores_max": max(others) if others else None})
    return rows


def calibrate_rows(rows, plans, runs, passes, stage_counts=STAGES, points=CALIBRATION_POINTS):
    """One calibration round per stage count, from the runs at `points` (m, b) of every pass
    (several runs: one run's noise is what a single-run calibration would keep). Each pass's
    profile is calibrated from them and re-predicts every point of its stage count; a point's
    calibrated time is the median over the passes, as the predictions before are."""
    calibrations = {}
    chosen = {stages: [(run["plan"], run["report"]) for m, b in points for run in runs[(stages, m, b)]]
              for stages in stage_counts}
    for rep in range(passes):
        for stages in stage_counts:
            calibrations[stages] = calibrate_profile(runs[(stages,) + points[0]][rep]["profile"],
                                                     chosen[stages])
        for row in rows:
            calibrated = calibrations[row["stages"]]
            # re-planned as `planner solve` plans from a calibrated profile
            replanned = plan_fixed(calibrated, plans[(row["stages"], row["m"], row["b"])], link_options(calibrated))
            row.setdefault("calibrated_runs_s", []).append(replanned.predicted_iteration_s)
    for row in rows:
        row["calibrated_s"] = statistics.median(row["calibrated_runs_s"])
    return calibrations


def summarize(name, rows, runs, calibrations, schedule="1f1b"):
    cal = calibrations[max(calibrations)].extra["calibration"]
    every = [r for done in runs.values() for r in done]
    return {"model": name, "schedule": schedule, "points": len(rows),
            "max_error_pct": max(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows) * 100, "mape_before_pct": mape(rows, "predicted_s"),
            "mape_after_pct": mape(rows, "calibrated_s"), "mape_simulated_pct": mape(rows, "simulated_s"),
            "mape_at_host_speed_pct": mape(rows, "at_host_speed_s"),
            "mape_replayed_pct": mape(rows, "replayed_s"),
            "signed_replayed_pct": statistics.mean((r["replayed_s"] - r["measured_s"]) / r["measured_s"]
                                                   for r in rows) * 100,
            "mape_first_tries_pct": mape(rows, "predicted_s", "first_measured_s"),
            "signed_before_pct": statistics.mean((r["predicted_s"] - r["measured_s"]) / r["measured_s"]
                                                 for r in rows) * 100,
            "runs": len(every), "remeasured_runs": sum(r["tries"] > 1 for r in every),
            "runs_off_after_retries": sum(r["host_off"] > SLOWDOWN_WARN for r in every),
            "step_overhead_ms": calibrations[min(calibrations)].extra["calibration"]["step_overhead_s"] * 1e3,
            "link_gbps": cal["bandwidth_bytes_per_s"] / 1e9, "latency_us": cal["latency_s"] * 1e6,
            "other_cores_max": max((r["other_cores_max"] or 0.0) for r in rows)}


def print_tables(summary, all_rows):
    print()
    print("| model | schedule | points | MAPE before | largest error | MAPE before, first tries | mean signed error | "
          "MAPE simulated | MAPE at the runs' host speed | MAPE replayed at the runs' compute | MAPE after one calibration | runs re-measured (still off) | per-step overhead "
          "(1 stage) | link after calibration (2 stages) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        print(f"| {s['model']} | {s['schedule']} | {s['points']} | {s['mape_before_pct']:.1f} % | "
              f"{s['max_error_pct']:.1f} % | {s['mape_first_tries_pct']:.1f} % | "
              f"{s['signed_before_pct']:+.1f} % | {s['mape_simulated_pct']:.1f} % | {s['mape_at_host_speed_pct']:.1f} % | "
              f"{s['mape_replayed_pct']:.1f} % ({s['signed_replayed_pct']:+.1f} %) | {s['mape_after_pct']:.1f} % | "
              f"{s['remeasured_runs']} of {s['runs']} ({s['runs_off_after_retries']}) | "
              f"{s['step_overhead_ms']:.2f} ms | {s['link_gbps']:.2f} GB/s, {s['latency_us']:.0f} us |")
    print()
    print("| model | schedule | S | m | b | predicted ms (median) | simulated ms | replayed ms | calibrated ms | measured ms (median) | "
          "passes: predicted / measured ms | tries | other processes, cores (max) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in all_rows:
        other = "" if r["other_cores_max"] is None else f"{r['other_cores_max']:.2f}"
        print(f"| {r['model']} | {r['schedule']} | {r['stages']} | {r['m']} | {r['b']} | {r['predicted_s'] * 1e3:.2f} | "
              f"{r['simulated_s'] * 1e3:.2f} | {r['replayed_s'] * 1e3:.2f} | {r['calibrated_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | "
              f"{', '.join(f'{p * 1e3:.1f}/{t * 1e3:.1f}' for p, t in zip(r['predicted_runs_s'], r['measured_runs_s']))} | "
              f"{'/'.join(map(str, r['tries']))} | {other} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--passes", type=int, default=5,
                        help="passes over the grid; a point's measured time is the median over passes (default 5)")
    parser.add_argument("--json", help="write all rows here")
    parser.add_argument("--retries", type=int, default=RETRIES,
                        help=f"runs (and profiles) measured again, at most this many times, while the host's speed is "
                             f"off the profile's by more than 10 %% (default {RETRIES})")
    parser.add_argument("--micro-batches", default=",".join(map(str, MICRO_BATCHES)),
                        help="micro-batch counts m of the grid (default 2,4,8)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="micro-batch sizes b (default 2,4)")
    parser.add_argument("--warmup", type=float, default=0.5, help="profile warm-up seconds (planner profile --warmup)")
    parser.add_argument("--min-time", type=float, default=1.0,
                        help="profile: timed seconds per micro-batch size at least (planner profile --min-time)")
    parser.add_argument("--no-co-runners", dest="co_runners", action="store_false",
                        help="profile every stage count alone (as --ranks-per-host 1) instead of with S - 1 co-runners")
    parser.add_argument("--no-link", dest="link", action="store_false",
                        help="plan with the 5 GB/s, 0 latency defaults instead of the measured link")
    parser.add_argument("--no-engine-cost", dest="engine_cost", action="store_false",
                        help="plan without the engine's own cost per forward and backward (planner profile "
                             "--engine-cost none)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="profile and run on this device (cuda: one GPU per stage; no co-runners, no gloo link)")
    add_grid_options(parser)  # --models, --model SPEC --model-arg K=V, --schedule, --virtual-stages
    parser.add_argument("--stages", default=",".join(map(str, STAGES)), help="stage counts of the grid (default 1,2)")
    args = parser.parse_args()
    try:
        args.stage_counts = sorted({int(s) for s in args.stages.split(",")})
    except ValueError:
        sys.exit(f"error: --stages {args.stages!r} must be comma-separated integers, e.g. 1,2")
    if args.retries < 0:
        sys.exit(f"error: --retries must be >= 0 (got {args.retries})")
    if not args.stage_counts or args.stage_counts[0] < 1:
        sys.exit("error: --stages needs positive integers")
    try:
        args.m_list = sorted({int(x) for x in args.micro_batches.split(",")})
        args.size_list = sorted({int(x) for x in args.sizes.split(",")})
    except ValueError:
        sys.exit("error: --micro-batches and --sizes are comma-separated integers, e.g. 8,16")
    try:
        args.schedule_list = grid_schedules(args.schedule, args.virtual_stages)
        args.model_table = grid_models(args.models, getattr(args, "spec_models", None))
    except ValueError as e:
        sys.exit(f"error: {e}")
    # the calibration round's runs: the middle micro-batch count at (up to) the two smallest sizes
    args.calibration_points = tuple((args.m_list[len(args.m_list) // 2], b) for b in args.size_list[:2])
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("error: --device cuda but CUDA is not available here; run on a GPU machine or drop --device")
        gpus = torch.cuda.device_count()
        if max(args.stage_counts) > gpus:
            print(f"note: {gpus} GPU(s): stage counts above {gpus} left out (a stage per GPU)", flush=True)
            args.stage_counts = [s for s in args.stage_counts if s <= gpus]
        # co-runners model ranks sharing a CPU host, and the profile's link is gloo between CPU processes
        args.co_runners, args.link = False, False
    started = time.time()
    all_rows, summary = [], []
    for name in args.model_table:
        every_plan, every_run = run_passes(name, args)
        for schedule in args.schedule_list:
            plans = {key[1:]: plan for key, plan in every_plan.items() if key[0] == schedule}
            runs = {key[1:]: done for key, done in every_run.items() if key[0] == schedule}
            rows = grid_rows(name, plans, runs, schedule)
            calibrations = calibrate_rows(rows, plans, runs, args.passes, args.stage_counts, args.calibration_points)
            summary.append(summarize(name, rows, runs, calibrations, schedule))
            all_rows += rows
    print_tables(summary, all_rows)
    print(f"\n{time.time() - started:.0f} s")
    if args.json:
        write_json_atomic(args.json, {"summary": summary, "rows": all_rows, "settings": vars(args)})


if __name__ == "__main__":
    main()
