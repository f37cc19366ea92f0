"""Plan quality on real runs: measured step time of the ILP's plan vs the equal-units split
(DeepSpeed's `uniform`) and the parameter-balanced split (DeepSpeed's `parameters`).

    .venv/bin/python benchmarks/plan_quality.py [--steps 8] [--reps 5] [--micro-batches 8] [--vocab 16384]

gpt with a large vocabulary (the LM head costs several blocks), 2 stages on this CPU, 1 thread
per rank, m = 8 micro-batches of 4 (m >= 4p, as real pipelines run). The profile is measured as
the two ranks run (`planner profile --ranks-per-host 2`: one co-runner on the other core, warm-up,
round-robin, at least 1 s timed) and the link is measured (`--link measure`); every method plans
at the same micro-batch size and count (the profile holds one size), so the comparison is about
the split alone; each plan runs `--reps` times, interleaved
(ilp, uniform, params, ilp, ...) so that machine noise hits all alike; the table gives the median.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# ranks started as this process's own children, so that its CPU accounting (RUSAGE_CHILDREN) counts
# them and "other processes" means other jobs (forked from runtime.launch's fork server they would not be)
os.environ.setdefault("PIPEPLANNER_LAUNCH", "subprocess")
from fidelity import measured_run  # noqa: E402

from planner.cost.options import CostOptions  # noqa: E402
from planner.plan.make import make_plan  # noqa: E402
from planner.profile.link import measure_link  # noqa: E402
from planner.profile.rhythm import rhythm_compute  # noqa: E402
from planner.profile.measure import profile_model  # noqa: E402
from planner.solve.api import solve  # noqa: E402

MODEL = ("builtin:gpt", {"vocab": 16384, "dim": 128, "layers": 8, "seq_len": 32})  # head ~ 10 blocks
METHODS = ("ilp", "uniform", "params")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5,
                        help="runs per split, interleaved; the median is reported (default 5: the first rep "
                             "of each split often runs slow, and one slow rep in three moves a median)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8, help="m (default 8: m >= 4p, as real pipelines run)")
    parser.add_argument("--vocab", type=int, default=MODEL[1]["vocab"])
    parser.add_argument("--no-link", dest="link", action="store_false",
                        help="plan with the 5 GB/s, 0 latency defaults instead of the measured link")
    args = parser.parse_args()
    entry, model_args = MODEL[0], dict(MODEL[1], vocab=args.vocab)
    # profiled as the 2 ranks will run: 1 thread, one co-runner on the other core, warm, 1 s per size
    profile = profile_model(entry, model_args, [args.micro_batch], threads=1, repeats=7, warmup_s=0.5,
                            min_time_s=1.0, co_runners=1)
    link = {}
    if args.link:
        measured = measure_link(sorted({c.activation_bytes(args.micro_batch) for c in profile.cuts}),
                                rhythm=rhythm_compute(profile))
        link = {"bandwidth": measured["bandwidth_bytes_per_s"], "latency": measured["latency_s"]}
        print(f"link {link['bandwidth'] / 1e9:.2f} GB/s, latency {link['latency'] * 1e6:.0f} us", flush=True)
    print(f"{entry} {model_args}, 2 stages, micro-batch {args.micro_batch} x {args.micro_batches}", flush=True)
    opts = CostOptions(pipeline_ranks=2, global_batch=args.micro_batch * args.micro_batches, schedule="1f1b",
                       **link)
    plans = {}
    for method in METHODS:
        solution = solve(profile, opts, method=method)
        plans[method] = make_plan(profile, solution, opts, "benchmark")
        stages = plans[method].stages
        print(f"{method:8} split after {stages[0].units[-1]!r}: predicted "
              f"{plans[method].predicted_iteration_s * 1e3:.1f} ms", flush=True)
    measured = {m: [] for m in METHODS}
    others = []
    for rep in range(args.reps):
        for method in METHODS:
            report, other = measured_run(plans[method], args.steps)
            measured[method].append(report["measured_iteration_s"])
            others.append(other or 0.0)
            print(f"  rep {rep + 1} {method:8} {measured[method][-1] * 1e3:.1f} ms"
                  + (f" (other processes: {other:.2f} cores)" if other is not None else ""), flush=True)
    median = {m: statistics.median(v) for m, v in measured.items()}
    print()
    print("| method | split (stage 0 ends after) | predicted ms | measured ms (median) | measured vs ilp |")
    print("| --- | --- | --- | --- | --- |")
    for method in METHODS:
        plan = plans[method]
        print(f"| {method} | {plan.stages[0].units[-1]} | {plan.predicted_iteration_s * 1e3:.1f} | "
              f"{median[method] * 1e3:.1f} | {median[method] / median['ilp']:.2f}x |")
    worse = max(median["uniform"], median["params"])
    for method in METHODS:
        print(f"{method} runs: " + ", ".join(f"{t * 1e3:.1f}" for t in measured[method]) + " ms")
    print(f"other processes kept at most {max(others):.2f} cores busy during a run")
    print(f"\nilp is {worse / median['ilp']:.2f}x faster than the worse baseline, "
          f"{min(median['uniform'], median['params']) / median['ilp']:.2f}x than the better one")


if __name__ == "__main__":
    main()
