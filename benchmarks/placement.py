"""Placement on a leveled topology (issue 22): two sites x 2 devices joined by a slow link (default
100 MB/s, 20 ms, emulated on this machine). The plan `planner solve --topology` picks (p x d, the
placement and the split, knowing the link) against the best plan that ignores the link (the same
solve with the site link as fast as the links inside a site), each predicted on the link and
measured with `runtime execute` holding every message and exchange that crosses it for its planned
time (runtime/emulation.py).

    .venv/bin/python benchmarks/placement.py [--models 1024x4 256x4] [--steps 6]
"""
import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_plan  # noqa: E402
from planner.cost.model import compute_profile, evaluate  # noqa: E402
from planner.cost.options import CostOptions  # noqa: E402
from planner.cost.placement import Placement  # noqa: E402
from planner.cost.topology_file import topology_from_json  # noqa: E402
from planner.plan.make import make_plan  # noqa: E402
from planner.profile.measure import profile_model  # noqa: E402
from planner.solve.placed import solve_on_topology  # noqa: E402
from planner.sizes import parse_bytes  # noqa: E402


def topology(bandwidth, latency, emulate):
    site = {"name": "site", "count": 2, "emulate": emulate}
    if bandwidth is not None:
        site.update(bandwidth=bandwidth, latency=latency)
    return topology_from_json({"levels": [site, {"name": "device", "count": 2}]})


def on_the_link(profile, solution, link_topology):
    """The solution's plan with its placement on the real topology: predicted there."""
    opts = solution.options.with_(placement=Placement(link_topology, solution.options.placement.devices))
    cost = evaluate(compute_profile(profile, opts), solution.boundaries, solution.micro_batch_size, opts,
                    solution.recompute)
    placed = dataclasses.replace(solution, num_micro_batches=cost.num_micro_batches, cost=cost,
                                 objective=cost.iteration_s, options=opts)
    return make_plan(profile, placed, opts, "benchmark")


def describe(plan):
    cuts = [st.end_unit for st in plan.stages[:-1]]
    return (f"p {plan.pipeline_stages} x d {plan.data_parallel}, b {plan.micro_batch_size}, cuts {cuts}, "
            f"placement {plan.placement}, emulated boundaries {plan.emulated_boundaries}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["1024x4", "256x4"], help="builtin:mlp widths x layers")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--bandwidth", default="100MB", help="the site link's bandwidth")
    ap.add_argument("--latency", type=float, default=0.02, help="the site link's latency, seconds")
    ap.add_argument("--steps", type=int, default=6)
    # inside a site: loopback gloo as `planner profile --link measure` finds it on this machine when it is idle
    # (a loaded host's fit is too noisy to plan with)
    ap.add_argument("--inside", default="2GB", help="bandwidth between two devices of a site")
    ap.add_argument("--inside-latency", type=float, default=1e-4)
    ap.add_argument("--inside-all-reduce", default="1GB", help="the gradient exchange's rate inside a site")
    ap.add_argument("--message-cost", type=float, default=2e-5, help="seconds per message on each side")
    args = ap.parse_args()
    link = topology(args.bandwidth, args.latency, emulate=True)
    print(f"site link {args.bandwidth}/s, {args.latency * 1e3:.0f} ms (emulated); inside a site {args.inside}/s, "
          f"{args.inside_latency * 1e6:.0f} us, all-reduce {args.inside_all_reduce}/s; global batch {args.global_batch}")
    print("| model | plan | shape | predicted ignoring the link ms | predicted on the link ms | measured ms "
          "(fastest / median step) | error (fastest) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in args.models:
        dim, layers = (int(x) for x in model.split("x"))
        model_args = {"dim": dim, "layers": layers}
        # timed beside a co-runner (`planner profile --ranks-per-host 2`): this host's 2 cores are shared by
        # the 4 ranks, of which about two compute at a time while the others wait on the link
        profile = profile_model("builtin:mlp", model_args, [1, 2, 4], repeats=3, co_runners=1)
        opts = CostOptions(pipeline_ranks=1, global_batch=args.global_batch, bandwidth=parse_bytes(args.inside),
                           latency=args.inside_latency, message_s=args.message_cost,
                           dp_bandwidth=parse_bytes(args.inside_all_reduce))
        aware = solve_on_topology(profile, opts, link)
        blind = solve_on_topology(profile, opts, topology(None, None, emulate=False))
        for name, solution in (("solver (knows the link)", aware), ("best ignoring the link", blind)):
            plan = on_the_link(profile, solution, link)
            report = run_plan(plan, args.steps)
            times = [step["time_s"] for step in report["steps"][1:]]  # the first step warms up
            predicted = plan.predicted_iteration_s
            ignoring = f"{blind.objective * 1e3:.1f}" if solution is blind else "-"
            print(f"| mlp {model} | {name} | {describe(plan)} | {ignoring} | {predicted * 1e3:.1f} | "
                  f"{min(times) * 1e3:.1f} / {statistics.median(times) * 1e3:.1f} | "
                  f"{100 * (min(times) - predicted) / predicted:+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
