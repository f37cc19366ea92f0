"""The same plans on both engines of `runtime execute`, side by side in one run: this runtime's own
engine and `--engine torch` (torch.distributed.pipelining's PipelineStage and schedule classes).

    .venv/bin/python benchmarks/engines.py                 # ~4 minutes on 2 busy cores
    .venv/bin/python benchmarks/engines.py --reps 1 --steps 4

builtin:gpt (dim 128, 8 layers, vocab 8192, seq 64), global batch 16 as 4 micro-batches of 4, 2 ranks
(gloo, one thread each): gpipe and 1f1b with 2 stages (cut in the middle of the blocks), interleaved
and bfs with 4 stages (2 per rank). Each configuration runs `--reps` times per engine, alternating
which engine goes first; a run's step time is the report's median over its steady steps, waiting is
the ranks' mean `wait_s` (own: in batches of messages; torch: step minus compute and optimizer),
memory the ranks' largest peak resident set. The table gives the medians over repetitions and the
ratio own / torch of each repetition's pair (noise on a shared machine hits a pair alike).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import ROOT, run_plan  # noqa: F401  (puts the checkout on sys.path)

ARGS = dict(dim=128, layers=8, vocab=8192, seq_len=64)
PLANS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("bfs", 2)]  # (schedule, stages per rank)


def make_plans():
    from planner.plan.make import plan_for_split
    from planner.profile.measure import profile_model
    from tests.support.runs import reshape_plan

    profile = profile_model("builtin:gpt", dict(ARGS), [4], repeats=1)
    blocks = [i for i, u in enumerate(profile.units) if u.name.startswith("blocks.")]
    plans = {}
    for schedule, v in PLANS:
        if v == 1:
            plans[schedule] = plan_for_split(profile, [blocks[len(blocks) // 2]], 4, 16, schedule, "benchmark")
        else:
            cuts = [blocks[len(blocks) * k // 4] for k in (1, 2, 3)]
            plans[schedule] = reshape_plan(plan_for_split(profile, cuts, 4, 16, "gpipe", "benchmark"),
                                           virtual_stages=2, schedule=schedule)
    return plans


def measure(report: dict) -> dict:
    ranks = report["stages"]
    return {"step_ms": report["measured_iteration_s"] * 1e3,
            "wait_ms": statistics.mean(r["measured"]["wait_s"] for r in ranks) * 1e3,
            "rss_mib": max((r.get("peak_rss_bytes") or 0) for r in ranks) / 2**20,
            "loss": report["steps"][-1]["loss"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    plans = make_plans()
    print("| schedule | stages | own ms | torch ms | own / torch (median of pairs) | own waiting ms | torch waiting ms "
          "| own peak RSS MiB | torch peak RSS MiB | same final loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for schedule, plan in plans.items():
        runs = {"own": [], "torch": []}
        for rep in range(args.reps):
            for engine in (["own", "torch"] if rep % 2 == 0 else ["torch", "own"]):
                runs[engine].append(measure(run_plan(plan, args.steps, ["--engine", engine])))
        med = {e: {k: statistics.median(r[k] for r in runs[e]) for k in ("step_ms", "wait_ms", "rss_mib")}
               for e in runs}
        ratio = statistics.median(a["step_ms"] / b["step_ms"] for a, b in zip(runs["own"], runs["torch"]))
        same = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs["own"], runs["torch"]))
        print(f"| {schedule} | {len(plan.stages)} | {med['own']['step_ms']:.1f} | {med['torch']['step_ms']:.1f} | "
              f"**{ratio:.2f}** | {med['own']['wait_ms']:.1f} | {med['torch']['wait_ms']:.1f} | "
              f"{med['own']['rss_mib']:.0f} | {med['torch']['rss_mib']:.0f} | {'yes' if same < 1e-4 else f'no ({same:.1e})'} |",
              flush=True)
    print(f"\n{args.reps} repetitions x {args.steps} steps per engine and schedule; total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
