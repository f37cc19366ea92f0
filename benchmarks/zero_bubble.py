"""Zero-bubble schedules vs 1F1B on real runs: predicted and measured step time, same model and cuts.

    .venv/bin/python benchmarks/zero_bubble.py              # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/zero_bubble.py --reps 1 --steps 4   # ~1 minute

The built-in gpt (dim 128, 8 layers, vocab 512: the blocks dominate, so the stages balance) is
profiled once (`profile_model`, micro-batch 2) and cut into four chunks of two blocks each (the
embeddings with the first, the final norm and head with the last). On 2 ranks (gloo, one thread
each), global batch 16 as 8 micro-batches of 2, SGD:

* 1f1b:  stages = chunks 0-1 and 2-3;
* zb-h1: the same two stages;
* zb-v:  the four chunks as four stages in the V (rank 0: chunks 0 and 3, rank 1: chunks 1 and 2).

Each plan's prediction is the simulation of its lists with the profile's durations (`planner solve`'s
cost model, `plan_for_split`); each run's measurement is `runtime execute`'s median steady step. The
configurations run alternately, `--reps` times; the table gives the medians and each schedule's
ratio to 1f1b within the same repetition (noise from other jobs hits neighbours alike).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import run_plan  # noqa: E402

ENTRY, ARGS = "builtin:gpt", dict(dim=128, layers=8, vocab=512, seq_len=64)
MICRO_BATCH, GLOBAL_BATCH = 2, 16
SCHEDULES = ("1f1b", "zb-h1", "zb-v")


def plans():
    import torch

    from planner.plan.make import plan_for_split
    from planner.profile.measure import profile_model

    torch.set_num_threads(1)
    profile = profile_model(ENTRY, ARGS, [MICRO_BATCH], repeats=5)
    names = [u.name for u in profile.units]
    blocks = [i for i, n in enumerate(names) if n.startswith("blocks.")]
    quarters = [blocks[2], blocks[4], blocks[6]]  # chunk k starts at block 2k (k >= 1)
    return {
        "profile": profile,
        "1f1b": plan_for_split(profile, [quarters[1]], MICRO_BATCH, GLOBAL_BATCH, "1f1b", "benchmark"),
        "zb-h1": plan_for_split(profile, [quarters[1]], MICRO_BATCH, GLOBAL_BATCH, "zb-h1", "benchmark"),
        "zb-v": plan_for_split(profile, quarters, MICRO_BATCH, GLOBAL_BATCH, "zb-v", "benchmark"),
    }


def unit_time_table() -> None:
    """The bubble of each schedule's lists at forward = input backward = weight backward = 1 unit
    (1F1B's whole backward 2; v stages per rank split the work evenly), messages free: the
    simulation the planner predicts with (planner.pipeline.simulate), no measurement."""
    from planner.pipeline.simulate import unit_time_step

    print("| p | m | 1f1b | zb-h1 | zb-v | interleaved (v = 2) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for p, m in ((2, 4), (4, 8), (4, 16), (8, 16), (8, 32)):
        row = [f"{unit_time_step(name, p, m, v) - 3 * m:g}"
               for name, v in (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("interleaved", 2))]
        print(f"| {p} | {m} | " + " | ".join(row) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", help="write the raw numbers here")
    parser.add_argument("--simulated-only", action="store_true", help="print the unit-time bubbles and stop")
    args = parser.parse_args(argv)
    print("bubble (units of one forward) at equal forward, input and weight backward times:")
    unit_time_table()
    if args.simulated_only:
        return 0
    started = time.perf_counter()
    made = plans()
    profile = made["profile"]
    whole = sum(u.backward_s[MICRO_BATCH] for u in profile.units)
    parts = sum(u.backward_input_s[MICRO_BATCH] + u.backward_weight_s[MICRO_BATCH] for u in profile.units)
    weight = sum(u.backward_weight_s[MICRO_BATCH] for u in profile.units)
    print(f"\nprofile: backward {whole * 1e3:.2f} ms per micro-batch (all units), split in two parts "
          f"{parts * 1e3:.2f} ms ({parts / whole:.2f}x), of which the weight part {weight * 1e3:.2f} ms")
    runs = {s: [] for s in SCHEDULES}
    for rep in range(args.reps):
        order = SCHEDULES if rep % 2 == 0 else tuple(reversed(SCHEDULES))
        for schedule in order:
            report = run_plan(made[schedule], args.steps)
            runs[schedule].append(report["measured_iteration_s"])
            print(f"rep {rep + 1} {schedule:<6} measured {report['measured_iteration_s'] * 1e3:8.2f} ms", flush=True)
    print(f"\n{platform.processor() or platform.machine()}, torch threads 1 per rank, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, {time.perf_counter() - started:.0f} s")
    print("| schedule | predicted ms | measured ms | predicted / 1f1b | measured / 1f1b (per rep) |")
    print("|---|---:|---:|---:|---|")
    base_pred = made["1f1b"].predicted_iteration_s
    out = {}
    for schedule in SCHEDULES:
        pred = made[schedule].predicted_iteration_s
        ratios = [m / b for m, b in zip(runs[schedule], runs["1f1b"])]
        out[schedule] = {"predicted_s": pred, "measured_s": runs[schedule], "ratios": ratios}
        print(f"| {schedule} | {pred * 1e3:.2f} | {statistics.median(runs[schedule]) * 1e3:.2f} | "
              f"{pred / base_pred:.3f} | **{statistics.median(ratios):.3f}** ({', '.join(f'{r:.3f}' for r in ratios)}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
