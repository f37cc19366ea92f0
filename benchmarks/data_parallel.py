"""Pure data parallelism on one CPU host: the gradient all-reduce through gloo and through shared memory.

For each model: `planner profile` (the link measured over `--p2p auto`, so the plan's all-reduce
rate is shared memory's), `planner solve --devices D` (the plan's shape is printed: the models here
get pure data parallelism), then `runtime execute` of that plan under `--p2p gloo` and `--p2p auto` in alternation, `--rounds`
times each. Prints per run the measured step, the ranks' mean all-reduce time (`reduce_s`, which
includes waiting for the slower replica) and the median's error against the prediction.

    python benchmarks/data_parallel.py --models mlp,gpt,resnet --devices 2 --global-batch 16
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from common import ROOT, run_plan

from planner.plan.file import load_plan


def _cli(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=ROOT, env=env, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,resnet", help="builtin models, comma-separated")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--sizes", default="1,2,4", help="micro-batch sizes profiled")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print("| model | plan | predicted ms | transport | measured ms (each run) | all-reduce ms (mean of ranks) | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            profile, plan_path = os.path.join(tmp, f"{model}.json"), os.path.join(tmp, f"{model}.plan.json")
            _cli("profile", f"builtin:{model}", "--micro-batch-sizes", args.sizes, "-o", profile)
            _cli("solve", profile, "--devices", str(args.devices), "--global-batch", str(args.global_batch),
                 "-o", plan_path)
            plan = load_plan(plan_path)
            shape = f"p = {plan.pipeline_stages}, d = {plan.data_parallel}, m = {plan.num_micro_batches}, b = {plan.micro_batch_size}"
            runs = {"gloo": [], "auto": []}
            for _ in range(args.rounds):
                for p2p in runs:
                    runs[p2p].append(run_plan(plan, args.steps, ["--p2p", p2p]))
            for p2p, reports in runs.items():
                measured = [r["measured_iteration_s"] for r in reports]
                reduce = [statistics.mean(s["measured"]["reduce_s"] for s in r["stages"]) for r in reports]
                median = statistics.median(measured)
                print(f"| {model} | {shape} | {plan.predicted_iteration_s * 1e3:.2f} | {p2p} | "
                      f"{', '.join(f'{t * 1e3:.2f}' for t in measured)} | "
                      f"{', '.join(f'{t * 1e3:.2f}' for t in reduce)} | "
                      f"{(median - plan.predicted_iteration_s) / plan.predicted_iteration_s * 100:+.1f} % |", flush=True)


if __name__ == "__main__":
    main()
