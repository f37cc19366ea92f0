"""Solve time and gap of the exact search: random chains (L <= 130, p <= 16; G = 32, or 4 p for interleaved)
and the PipeDream profiles.

    .venv/bin/python benchmarks/solver_speed.py [--samples 20] [--backends highs,cbc] [--skip-pipedream]
        [--schedules 1f1b,interleaved] [--time-limit 60] [--gap 0.01] [--profiles resnet101,...] [--stages 2,4,8,16]

Each row: p95 and max solve seconds, the largest gap at the end, how many were proven optimal (within --gap), and the
solver process's CPU seconds (HiGHS runs in it, one thread): on a shared machine wall time over CPU time is
the other load's share.

PipeDream graphs are read from ../shared/external/pipedream-profiles/ (skipped with a message if
missing), imported at batch size 64, planned with G = 64 x 2 x S.
"""
import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planner.cost.options import CostOptions  # noqa: E402
from planner.profile.pipedream import import_pipedream  # noqa: E402
from planner.solve.api import solve  # noqa: E402
from tests.support.synthetic import random_chain  # noqa: E402

PIPEDREAM = os.path.join(ROOT, "..", "shared", "external", "pipedream-profiles")


def chain(rng, L):
    return random_chain(rng, L, sizes=(1, 2, 4, 8))


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--backends", default="highs,cbc")
    ap.add_argument("--skip-pipedream", action="store_true")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--schedules", default="1f1b,interleaved")
    ap.add_argument("--gap", type=float, default=1e-6, help="stop each solve once proven within this gap")
    ap.add_argument("--profiles", default=None, help="PipeDream profiles to solve (names before .graph.txt; default all)")
    ap.add_argument("--stages", default="2,4,8,16", help="S for the PipeDream profiles")
    args = ap.parse_args()
    backends = args.backends.split(",")
    for schedule in args.schedules.split(",") if args.samples > 0 else ():
        rng = random.Random(0)
        v = 2 if schedule in ("interleaved", "bfs") else 1
        problems = []
        for _ in range(args.samples):
            L = rng.randint(2 * v, 130)
            S = rng.randint(1, min(16, L // v))
            opts = CostOptions(pipeline_ranks=S, global_batch=4 * S if v > 1 else 32, latency=1e-5,
                               schedule=schedule, virtual_stages=v)
            problems.append((chain(rng, L), opts))
        for backend in backends:
            times, cpu, gaps, proven = [], [], [], 0
            for p, opts in problems:
                started = time.process_time()
                found = solve(p, opts, backend=backend, time_limit=args.time_limit, gap=args.gap)
                cpu.append(time.process_time() - started)
                times.append(found.seconds)
                gaps.append(found.gap)
                proven += found.gap <= args.gap
            print(f"chains L <= 130, p <= 16, {schedule} (v = {v}), {backend}: p95 {p95(times):.2f} s, "
                  f"max {max(times):.2f} s, max gap {max(gaps):.2%}, proven {proven}/{len(problems)}; this process's CPU: "
                  f"p95 {p95(cpu):.2f} s, max {max(cpu):.2f} s (wall over CPU: other load)", flush=True)
    if args.skip_pipedream:
        return
    if not os.path.isdir(PIPEDREAM):
        print(f"PipeDream profiles not found at {PIPEDREAM}; skipped")
        return
    wanted = set(args.profiles.split(",")) if args.profiles else None
    for name in sorted(f for f in os.listdir(PIPEDREAM) if f.endswith(".graph.txt")):
        if wanted is not None and name[: -len(".graph.txt")] not in wanted:
            continue
        p = import_pipedream(os.path.join(PIPEDREAM, name), 64)
        for backend in backends:
            row = []
            for S in (int(x) for x in args.stages.split(",")):
                found = solve(p, CostOptions(pipeline_ranks=S, global_batch=64 * 2 * S), backend=backend,
                              time_limit=args.time_limit, gap=args.gap)
                row.append(f"S={S}: {found.seconds:.2f} s gap {found.gap:.1e} ({found.method})")
            print(f"{name.split('.')[0]} ({p.num_units} units) {backend}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
