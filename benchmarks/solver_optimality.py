"""ILP vs the exact chain DP on random chain profiles: same optimum (relative <= 1e-6)?

    .venv/bin/python benchmarks/solver_optimality.py [--count 1000] [--seed 0]
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner.cost.options import CostOptions  # noqa: E402
from planner.solve.api import solve  # noqa: E402
from planner.solve.diagnose import InfeasibleError  # noqa: E402
from tests.support.synthetic import synthetic_profile  # noqa: E402


def random_problem(rng):
    L = rng.randint(2, 40)
    S = rng.randint(1, min(8, L))
    sizes = tuple(sorted(rng.sample([1, 2, 4, 8], rng.randint(1, 3))))
    per = lambda lo, hi: {b: rng.uniform(lo, hi) * (0.5 + b) for b in sizes}
    p = synthetic_profile([per(1e-3, 1e-2) for _ in range(L)], [per(2e-3, 2e-2) for _ in range(L)],
                          [rng.randint(0, 8 << 20) for _ in range(L)], [rng.randint(0, 4 << 20) for _ in range(L)],
                          [rng.randint(0, 2 << 20) for _ in range(L - 1)], sizes=sizes)
    opts = CostOptions(pipeline_ranks=S, global_batch=rng.choice([8, 16, 32]), schedule=rng.choice(["1f1b", "gpipe"]),
                       bandwidth=rng.choice([1e8, 1e9, 1e10]), latency=rng.choice([0.0, 1e-4]))
    if rng.random() < 0.5:
        peak = max(solve(p, opts, method="dp").cost.device_memory)
        opts = opts.with_(memory_cap=peak * rng.uniform(0.7, 1.0))
    return p, opts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    worst, mismatches, infeasible, t_ilp, t_dp = 0.0, 0, 0, [], []
    for i in range(args.count):
        p, opts = random_problem(rng)
        try:
            started = time.perf_counter()
            dp = solve(p, opts, method="dp")
            t_dp.append(time.perf_counter() - started)
        except InfeasibleError:
            infeasible += 1
            try:
                solve(p, opts)
                mismatches += 1
            except InfeasibleError:
                pass
            continue
        started = time.perf_counter()
        ilp = solve(p, opts)
        t_ilp.append(time.perf_counter() - started)
        rel = abs(ilp.objective - dp.objective) / dp.objective
        worst = max(worst, rel)
        if rel > 1e-6 or ilp.status != "optimal":
            mismatches += 1
            print(f"mismatch #{i}: ilp {ilp.objective} ({ilp.status}) dp {dp.objective}")
    t_ilp.sort()
    t_dp.sort()
    print(f"{args.count} chains (seed {args.seed}), {infeasible} infeasible for both: mismatches {mismatches}, "
          f"max relative difference {worst:.2e}; median solve ilp {t_ilp[len(t_ilp) // 2]:.3f} s, "
          f"dp {t_dp[len(t_dp) // 2]:.3f} s; p95 ilp {t_ilp[int(0.95 * len(t_ilp))]:.3f} s")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
