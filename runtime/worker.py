"""One rank of a pipeline run. Started by `runtime execute`, or by torchrun on several machines
(it reads the usual RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables):

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m runtime.worker plan.json --out-dir run/ --steps 100

Writes DIR/rank{R}.json (per-step timings and losses), DIR/rank{R}.pt (its stages' state, with
--save-state), DIR/rank{R}.trace.json (with --trace) and, if it fails, DIR/rank{R}.error (one
line) and the traceback on stderr.

This module is the rank's entry point and its error reporting; its set-up is runtime.rank_setup, its
transport runtime.rank_transport, its step loop runtime.rank_steps, what it writes runtime.rank_results.
"""
from __future__ import annotations

import argparse
import datetime
import os
import resource
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from planner.jsonio import atomic_path
from planner.model.failures import first_line
from planner.profile.allocator import retain_freed_memory
from runtime.options import (END_WITH_PARENT, ENGINES, OPTIMIZERS, P2P, P2P_HELP, RANK_TIMEOUT_S,
                             add_training_options)
from runtime.rank_results import write_results
from runtime.rank_setup import build_engine, check_same_plan, current_rss, resume_step, start_rank
from runtime.rank_steps import time_host, train_steps
from runtime.rank_transport import (close_tie_reducers, measure_rank_link, shared_reducer, shared_transport,
                                    use_shared_memory)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m runtime.worker", description="one rank of a pipeline run")
    p.add_argument("plan")
    p.add_argument("--out-dir", default="runtime-out", help="where this rank writes its results (default runtime-out)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: the plan's optimizer")
    add_training_options(p)
    p.add_argument("--save-state", action="store_true")
    p.add_argument("--init-state", default=None, help="start from this state_dict (.pt, .safetensors or a "
                   "save_pretrained directory); only this rank's stages are materialised")
    p.add_argument("--timeout", type=float, default=RANK_TIMEOUT_S,
                   help=f"seconds a rank may wait on another (default {RANK_TIMEOUT_S:g})")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: as profiled)")
    p.add_argument("--progress", action="store_true", help="print a line per step")
    p.add_argument("--trace", action="store_true", help="record every action's start and end")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--measure-link", action="store_true", help="ping-pong once before training: p2p latency and bandwidth")
    p.add_argument("--engine", choices=ENGINES, default="own",
                   help="own: this runtime's engine; torch: torch.distributed.pipelining's stages and schedules")
    p.add_argument("--p2p", choices=P2P, default="auto", help=P2P_HELP)
    return p.parse_args(argv)


def run(args) -> None:
    """One rank's whole run: join the group, build, train, write what it measured."""
    retain_freed_memory()  # as the profile did: no page faults for every micro-batch's buffers
    me = start_rank(args)
    me.start_rss = current_rss()
    # On GPUs NCCL moves CUDA tensors; gloo serves the few CPU ones (plan hash, losses).
    backend = "cpu:gloo,cuda:nccl" if me.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=me.rank, world_size=me.world,
                            timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=me.device if me.device.type == "cuda" else None)
    try:
        if me.device.type == "cuda":
            # every rank joins the NCCL communicator now: a batch_isend_irecv must not be its first use
            dist.all_reduce(torch.zeros(1, device=me.device))
        me.digest = me.plan.digest()
        check_same_plan(me.digest, me.rank, me.world)
        build_engine(me, use_tags=me.device.type != "cuda")
        if args.p2p == "auto" and args.engine == "own" and me.device.type == "cpu":
            use_shared_memory(me)
        me.built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        first_step = resume_step(me)
        link = measure_rank_link(me.plan, me.topology, me.rank, me.device, shared_transport(me)) \
            if args.measure_link else None
        host_kernel = [time_host(me.device)]
        steps = train_steps(me, first_step)
        host_kernel.append(time_host(me.device))
        write_results(me, first_step, steps, link, host_kernel)
        dist.barrier()
    except BaseException as e:
        _write_error(args, e)  # before leaving the group: the others fail once it is gone, and the
        raise                  # launcher names the rank whose error file came first
    finally:
        if shared_reducer(me) is not None:
            shared_reducer(me).close()
        close_tie_reducers(me)
        if shared_transport(me) is not None:
            shared_transport(me).close()
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux, ranks `runtime execute` started (runtime.launch sets END_WITH_PARENT to the parent's
    pid): this rank gets SIGTERM when the process that started it ends (the fork server, which ends
    with `runtime execute`, or `runtime execute` itself): a launcher killed with SIGKILL cannot stop its ranks,
    which would otherwise run on, or wait for their peers until the timeout. Not under torchrun,
    whose agent stops its workers itself (and the signal follows the thread that started a process)."""
    parent = os.environ.get(END_WITH_PARENT, "")
    if not sys.platform.startswith("linux") or not parent.isdigit():
        return
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    # the parent's pid comes from the launcher: a rank started as `python -m runtime.worker` gets here
    # after importing torch, seconds in which its parent may have been killed already
    if prctl(1, signal.SIGTERM, 0, 0, 0) == 0 and os.getppid() != int(parent):  # 1: PR_SET_PDEATHSIG
        os.kill(os.getpid(), signal.SIGTERM)  # it ended before the request was made


def main(argv=None) -> int:
    _die_with_parent()
    args = _parse(argv)
    try:
        run(args)
        return 0
    except BaseException as e:  # report once, in one line, for the launcher to print
        _write_error(args, e)
        traceback.print_exc(file=sys.stderr)
        return 1


def _write_error(args, error: BaseException) -> None:
    """OUT_DIR/rank{R}.error: the error in one line (once per rank: the first place it is caught)."""
    if getattr(error, "_pipeplanner_reported", False):
        return
    message = first_line(error)  # torch's messages may start with a blank line
    if error.__cause__ is not None and message.endswith("failed to run forward:"):
        # torch.distributed.pipelining (--engine torch) wraps a stage's own error, its cause, in this
        message = f"{message} {first_line(error.__cause__)}"
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        with atomic_path(os.path.join(args.out_dir, f"rank{os.environ.get('RANK', '?')}.error")) as tmp:
            with open(tmp, "w") as f:
                f.write(message + "\n")
        error._pipeplanner_reported = True
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
