"""One rank of a pipeline run. Started by `runtime execute` (or by torchrun: it reads the usual
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables).

    python -m runtime.worker PLAN --out-dir DIR [--steps N] [--lr LR] [--save-state]

Writes DIR/rank{R}.json (per-step timings and losses), DIR/rank{R}.pt (its stage's state,
with --save-state) and, if it fails, DIR/rank{R}.error (one line) and the traceback on stderr.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

from planner.jsonio import read_json, write_json_atomic
from runtime import schedule as sched
from runtime.comm import PointToPoint
from runtime.engine import Engine
from runtime.stage import build_stage, stage_state


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m runtime.worker", description="one rank of a pipeline run")
    p.add_argument("plan")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--save-state", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: as profiled)")
    p.add_argument("--progress", action="store_true", help="print a line per step (from the last stage)")
    return p.parse_args(argv)


def _device_for(plan, local_rank: int) -> torch.device:
    if plan.get("profile", {}).get("device") == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run(args) -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    plan = read_json(args.plan, what="plan")
    num_stages = len(plan["stages"])
    if world != num_stages:
        raise RuntimeError(f"the plan has {num_stages} stages but {world} ranks were started; "
                           f"start exactly {num_stages}")
    threads = args.threads or int(plan.get("profile", {}).get("threads", 1) or 1)
    torch.set_num_threads(threads)
    device = _device_for(plan, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        spec, stage = build_stage(plan, rank)
        stage.module.to(device)
        m = int(plan["num_micro_batches"])
        actions = sched.build_schedule(plan["schedule"], num_stages, m)[rank]
        optimizer = torch.optim.SGD(stage.module.parameters(), lr=args.lr) if list(stage.module.parameters()) \
            else _NoOptimizer()
        comm = PointToPoint(device, use_tags=backend == "gloo") if world > 1 else None
        engine = Engine(spec, stage, actions, int(plan["global_batch"]), m, optimizer, device, comm)
        dist.barrier()
        steps = []
        for step in range(args.steps):
            stats = engine.run_step(step)
            steps.append(stats.__dict__)
            if args.progress and stage.is_last:
                print(f"step {step + 1}/{args.steps}  loss {stats.loss:.4f}  time {stats.time_s * 1e3:.1f} ms",
                      flush=True)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = None
        result = {"rank": rank, "stage": rank, "threads": threads, "device": str(device), "steps": steps,
                  "peak_memory_bytes": peak}
        if args.save_state:
            torch.save(stage_state(stage, spec), os.path.join(args.out_dir, f"rank{rank}.pt"))
        write_json_atomic(os.path.join(args.out_dir, f"rank{rank}.json"), result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _NoOptimizer:
    """A stage without parameters still takes part in every step."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def main(argv=None) -> int:
    args = _parse(argv)
    rank = os.environ.get("RANK", "?")
    try:
        run(args)
        return 0
    except BaseException as e:  # report once, in one line, for the launcher to print
        message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        try:
            with open(os.path.join(args.out_dir, f"rank{rank}.error"), "w") as f:
                f.write(message + "\n")
        except OSError:
            pass
        traceback.print_exc(file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
