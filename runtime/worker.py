"""One rank of a pipeline run. Started by `runtime execute`, or by torchrun on several machines
(it reads the usual RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables):

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m runtime.worker plan.json --out-dir run/ --steps 100

Writes DIR/rank{R}.json (per-step timings and losses), DIR/rank{R}.pt (its stages' state, with
--save-state), DIR/rank{R}.trace.json (with --trace) and, if it fails, DIR/rank{R}.error (one
line) and the traceback on stderr.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from planner.plan.file import Plan, load_plan
from planner.profile.allocator import retain_freed_memory
from planner.jsonio import atomic_path, write_json_atomic
from planner.profile.measure import fit_link, ping_pong
from runtime import checkpoint as ckpt
from runtime.comm import PointToPoint
from runtime.engine import Engine, Groups
from planner.profile.hostspeed import reference_kernel_s
from planner.profile.optim import OPTIMIZERS, make_optimizer
from runtime.stage import build_rank, stage_state

def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m runtime.worker", description="one rank of a pipeline run")
    p.add_argument("plan")
    p.add_argument("--out-dir", default="runtime-out", help="where this rank writes its results (default runtime-out)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: the plan's optimizer")
    p.add_argument("--save-state", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rank may wait on another")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: as profiled)")
    p.add_argument("--progress", action="store_true", help="print a line per step")
    p.add_argument("--trace", action="store_true", help="record every action's start and end")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--recv-ahead", type=int, default=2,
                   help="receives posted ahead of the action that needs them (gloo; 0: post when needed)")
    p.add_argument("--measure-link", action="store_true", help="ping-pong once before training: p2p latency and bandwidth")
    return p.parse_args(argv)


def _check_same_plan(digest: str, rank: int, world: int) -> None:
    """Refuse to start if any rank read a different plan than rank 0 (e.g. a stale copy on one machine)."""
    mine = torch.tensor([int(digest[i:i + 8], 16) for i in range(0, 64, 8)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if not torch.equal(gathered[rank], gathered[0]):
        raise RuntimeError(f"this rank's plan differs from rank 0's (sha256 {digest[:12]}…): give every machine "
                           "the same plan file")


def _device_for(plan: Plan, local_rank: int) -> torch.device:
    if plan.profile.get("device") == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run(args) -> None:
    retain_freed_memory()  # as the profile did: no page faults for every micro-batch's buffers
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    os.makedirs(args.out_dir, exist_ok=True)
    plan = load_plan(args.plan)
    topology = plan.topology()
    if world != topology.world_size:
        raise RuntimeError(f"the plan needs {topology.world_size} ranks ({topology.pipeline_ranks} pipeline x "
                           f"{topology.data_parallel} data-parallel) but {world} were started")
    if args.recv_ahead < 0:
        raise ValueError("--recv-ahead must be 0 or more")
    threads = args.threads or int(plan.profile.get("threads", 1) or 1)
    torch.set_num_threads(threads)
    device = _device_for(plan, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        digest = plan.digest()
        _check_same_plan(digest, rank, world)
        pipeline_rank = topology.pipeline_rank_of(rank)
        rank_model = build_rank(plan, topology, pipeline_rank)
        for stage in rank_model.stages:
            stage.module.to(device)
        groups = Groups(topology, rank, rank_model.tied_groups)
        m = plan.num_micro_batches
        actions = plan.instruction_lists()[pipeline_rank]
        optimizer_name = args.optimizer or plan.optimizer
        if optimizer_name == "adam":
            optimizer_name = "adamw"
        optimizer = make_optimizer(optimizer_name, rank_model.parameters(), args.lr)
        comm = PointToPoint(device, use_tags=backend == "gloo") if topology.pipeline_ranks > 1 else None
        events: List[List[Any]] = []
        clock_offset = time.time() - time.perf_counter()  # perf_counter -> wall clock, shared by all ranks

        def record(kind, i, g, t0, t1):
            events.append([kind, i, g, t0 + clock_offset, t1 + clock_offset])

        engine = Engine(rank_model, actions, topology, rank, plan.global_batch, m, optimizer, device,
                        comm, groups, trace=record if args.trace else None, recv_ahead=args.recv_ahead)

        first_step = 0
        if args.resume:
            if not args.checkpoint_dir:
                raise RuntimeError("--resume needs --checkpoint-dir")
            done = ckpt.latest(args.checkpoint_dir, digest, world)
            if done is not None:
                saved = ckpt.load_rank(args.checkpoint_dir, done, rank)
                for stage in rank_model.stages:
                    stage.module.load_state_dict(saved["chunks"][str(stage.index)])
                optimizer.load_state_dict(saved["optimizer"])
                first_step = done
        link = _measure_link(plan, topology, rank) if args.measure_link else None
        # The host's speed, timed by all ranks at once as they compute (CPU hosts only: shared
        # cores are what drifts; on a GPU the kernel is not timed and no barriers are needed).
        timed_host = device.type == "cpu"
        if timed_host:
            dist.barrier()
        host_kernel = [reference_kernel_s(0.05, device=device) if timed_host else None]
        if timed_host:
            dist.barrier()
        is_reporter = pipeline_rank == topology.pipeline_ranks - 1 and topology.replica_of(rank) == 0
        steps = []
        for step in range(first_step, args.steps):
            stats = engine.run_step(step)
            if groups.data_parallel_group is not None and rank_model.stages[-1].is_last:
                stats.loss = _mean_over_holders(stats, groups)
            steps.append(dict(stats.__dict__))
            if args.progress and is_reporter:
                print(f"step {step + 1}/{args.steps}  loss {stats.loss:.4f}  time {stats.time_s * 1e3:.1f} ms",
                      flush=True)
            if args.checkpoint_dir and args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0:
                ckpt.save_rank(args.checkpoint_dir, step + 1, rank,
                               {str(st.index): st.module.state_dict() for st in rank_model.stages},
                               optimizer.state_dict())
                dist.barrier()  # every rank's file is in place before the step is marked complete
                if rank == 0:
                    ckpt.mark_complete(args.checkpoint_dir, step + 1, digest, world)
        if timed_host:
            dist.barrier()
        host_kernel.append(reference_kernel_s(0.05, device=device) if timed_host else None)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        # the parameters in memory on this rank, each once
        static = sum(p.numel() * p.element_size() for p in rank_model.parameters())
        result = {"rank": rank, "pipeline_rank": pipeline_rank, "replica": topology.replica_of(rank),
                  "lane": topology.lane_of(pipeline_rank), "chunks": [st.index for st in rank_model.stages],
                  "micro_batches": {str(st.index): len(topology.micro_batches_of(pipeline_rank, st.index, m))
                                    for st in rank_model.stages}, "threads": threads, "device": str(device),
                  "optimizer": optimizer_name, "first_step": first_step, "steps": steps, "peak_memory_bytes": peak,
                  "peak_saved_bytes": engine.saved.peak, "param_bytes": static, "link": link,
                  "host_kernel_s": host_kernel}
        if args.save_state and topology.replica_of(rank) == 0 and topology.lane_of(pipeline_rank) == 0:
            state: Dict[str, torch.Tensor] = {}
            for stage in rank_model.stages:
                state.update(stage_state(stage, rank_model.spec))
            with atomic_path(os.path.join(args.out_dir, f"rank{rank}.pt")) as tmp:
                torch.save(state, tmp)
        if args.trace:
            write_json_atomic(os.path.join(args.out_dir, f"rank{rank}.trace.json"), events)
        write_json_atomic(os.path.join(args.out_dir, f"rank{rank}.json"), result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure_link(plan: Plan, topology, rank: int, repeats: int = 10):
    """Ping-pong between pipeline ranks 0 and 1 of replica 0 at the plan's cut sizes (and 8 B,
    4 MiB), fit as `planner profile --link measure` fits it: latency and bandwidth. Other ranks
    take no part."""
    if topology.pipeline_ranks < 2 or rank not in (0, 1):
        return None
    sizes = sorted({8, 4 << 20} | {max(4, stage.activation_bytes_sent()) for stage in plan.stages[:-1]})
    samples = ping_pong(rank == 0, 1 - rank, sizes, repeats, warmup=2, tag=1 << 30)
    try:
        fit = fit_link(samples)
    except ValueError:  # time did not grow with size in this noisy sample: report no link
        return None
    return dict(fit, samples=samples, repeats=repeats)


def _mean_over_holders(stats, groups: Groups):
    """Each holder of the last stage (data-parallel replicas, stage replicas) knows the mean loss
    of its own micro-batches; the step's loss is the mean over all of them."""
    total = (stats.loss or 0.0) * stats.loss_count
    value = torch.tensor([total, float(stats.loss_count)], dtype=torch.float64)
    dist.all_reduce(value, group=groups.data_parallel_group)
    return float(value[0] / value[1]) if value[1] > 0 else None


def main(argv=None) -> int:
    args = _parse(argv)
    rank = os.environ.get("RANK", "?")
    try:
        run(args)
        return 0
    except BaseException as e:  # report once, in one line, for the launcher to print
        message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        try:
            os.makedirs(args.out_dir, exist_ok=True)
            with atomic_path(os.path.join(args.out_dir, f"rank{rank}.error")) as tmp:
                with open(tmp, "w") as f:
                    f.write(message + "\n")
        except OSError:
            pass
        traceback.print_exc(file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
