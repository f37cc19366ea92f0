"""Each schedule's simulated step at unit times: the lists the runtime executes, under its rules.

    .venv/bin/python benchmarks/schedule_steps.py [--depths 4,8] [--micro-batches 8,16,32] [--transfers 0,0.05,0.2]

A stage's forward takes 1/v, its backward 2/v (v stages per rank: the same work per rank whatever
v), a message `transfer` (in units of one rank's forward), nothing else. The ideal is 3 m + 3 (p - 1)/v
(1F1B's bubble shrunk v times). Milliseconds to run: the step graph of planner.pipeline.stepgraph,
no processes.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from planner.pipeline import schedule as sched  # noqa: E402
from planner.pipeline.simulate import simulate  # noqa: E402


def step(name: str, p: int, v: int, m: int, transfer: float) -> float:
    S = p * v
    value = {}
    for g in range(S):
        value.update({("forward", g): 1 / v, ("backward", g): 2 / v, ("backward_input", g): 1 / v,
                      ("backward_weight", g): 1 / v, ("act", g): transfer, ("grad", g): transfer})
    ranks = sched.stage_placement(name, S, v)
    timeline, _ = simulate(sched.build_schedule(name, S, m, v), value, lambda g, i: ranks[g])
    return timeline.step_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="4,8")
    ap.add_argument("--micro-batches", default="8,16,32")
    ap.add_argument("--transfers", default="0,0.05,0.2")
    args = ap.parse_args()
    print("| p | m | transfer | 1f1b | interleaved v=2 | bfs v=2 | zb-h1 | ideal v=2 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in map(int, args.depths.split(",")):
        for m in map(int, args.micro_batches.split(",")):
            if m < p:
                continue
            for t in map(float, args.transfers.split(",")):
                row = [step("1f1b", p, 1, m, t), step("interleaved", p, 2, m, t), step("bfs", p, 2, m, t),
                       step("zb-h1", p, 1, m, t)]
                print(f"| {p} | {m} | {t:g} | " + " | ".join(f"{x:.1f}" for x in row) + f" | {3 * m + 1.5 * (p - 1):.1f} |")


if __name__ == "__main__":
    main()
