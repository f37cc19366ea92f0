"""Replicated stages vs the best plan without them (p pipeline stages x d data-parallel replicas,
p d = N), on PipeDream's GPU-measured profiles: the solvers' predictions and the event simulation
of the runtime's instruction lists for both plans (1F1B; links and all-reduce at --bandwidth).

    .venv/bin/python benchmarks/replicas.py [--devices 4 8] [--models vgg16 alexnet ...]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner.cost.options import CostOptions  # noqa: E402
from planner.fidelity.simulation import simulate_plan  # noqa: E402
from planner.plan.make import make_plan  # noqa: E402
from planner.profile.pipedream import import_pipedream  # noqa: E402
from planner.solve.api import solve  # noqa: E402
from planner.solve.replicas import solve_replicated  # noqa: E402
from planner.solve.search import expand_scenarios  # noqa: E402

PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "external",
                        "pipedream-profiles")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--models", nargs="+", default=["vgg16", "alexnet", "resnet50", "gnmt"])
    ap.add_argument("--micro-batches", type=int, default=16, help="m (global batch = 64 x m)")
    ap.add_argument("--bandwidth", type=float, default=1.25,
                    help="GB/s of links and all-reduce (default 1.25: 10 GbE, as PipeDream's clusters)")
    args = ap.parse_args()
    print("| profile | N | best p x d: predicted / simulated ms | p x d | replicated: predicted / simulated ms "
          "| replicas x d | simulated speed-up | solve s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        path = os.path.join(PROFILES, f"{name}.graph.txt")
        profile = import_pipedream(path, batch_size=64)
        for n in args.devices:
            opts = CostOptions(pipeline_ranks=n, global_batch=64 * args.micro_batches, schedule="1f1b",
                               bandwidth=args.bandwidth * 1e9)
            started = time.perf_counter()
            plain = solve(profile, opts, method="dp", devices=n)
            scenarios = expand_scenarios(opts, 10 ** 9, n, ["1f1b"])
            replicated = solve_replicated(profile, scenarios[0], scenarios)
            seconds = time.perf_counter() - started
            sims = []
            for solution in (plain, replicated):
                plan = make_plan(profile, solution, solution.options or opts, path)
                sims.append((solution.objective, simulate_plan(plan).iteration_s))
            chosen = replicated.options
            reps = "+".join(str(r) for r in (chosen.replicas or (1,) * chosen.pipeline_ranks)) + f" x {chosen.data_parallel}"
            shape = f"{plain.options.pipeline_ranks} x {plain.options.data_parallel}"
            print(f"| {name} | {n} | {sims[0][0] * 1e3:.1f} / {sims[0][1] * 1e3:.1f} | {shape} | "
                  f"{sims[1][0] * 1e3:.1f} / {sims[1][1] * 1e3:.1f} | {reps} | {sims[0][1] / sims[1][1]:.2f}x | "
                  f"{seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
