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
import resource
import signal
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from planner.jsonio import atomic_path, write_json_atomic
from planner.model.failures import first_line
from planner.pipeline.check import check_schedule
from planner.pipeline.topology import Topology
from planner.plan.file import Plan, load_plan
from planner.profile.allocator import retain_freed_memory
from planner.profile.hostspeed import reference_kernel_s
from planner.profile.link import bounding_link_fit, fit_link, ping_pong
from planner.profile.optim import OPTIMIZERS
from runtime import checkpoint as ckpt
from runtime.emulation import exchange_delay, link_delays
from runtime.engine import Engine
from runtime.groups import Groups
from runtime.initstate import InitState
from runtime.link_probe import poster
from runtime.options import (END_WITH_PARENT, ENGINES, P2P, P2P_HELP, RANK_TIMEOUT_S, add_training_options,
                             run_refusal, training_options)
from runtime.training import GlobalNormClip, TrainOptions, lr_at, make_optimizer, optimizer_arguments, set_lr
from runtime.shard import shard_optimizer
from runtime.shard_params import ParameterSharding
from runtime.shared_memory import available, connect, ring_size
from runtime.shared_reduce import group_bytes, reducer
from runtime.stage import RankModel, build_rank, stage_state
from runtime.streams import start_stream

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


def _current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _check_same_plan(digest: str, rank: int, world: int) -> None:
    """Refuse to start if any rank read a different plan than rank 0 (e.g. a stale copy on one machine)."""
    # int64 on the CPU: the collective goes through gloo (the group is cpu:gloo,cuda:nccl on GPUs)
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


@dataclass
class _Rank:
    """This process in the run: its plan, place and device, and what it has built."""

    args: argparse.Namespace
    plan: Plan
    topology: Topology
    rank: int
    world: int
    device: torch.device
    threads: int
    digest: str = ""
    rank_model: Optional[RankModel] = None
    optimizer: Any = None
    optimizer_name: str = ""
    options: Optional[TrainOptions] = None
    groups: Optional[Groups] = None
    engine: Optional[Engine] = None
    sharding: Optional[ParameterSharding] = None  # a plan sharding parameters (runtime/shard_params.py)
    init_state: Optional[InitState] = None
    resumed_rng: Optional[Dict[str, Any]] = None
    p2p_note: str = ""  # why the run's messages do not go through shared memory, where they could
    start_rss: int = 0  # resident bytes before building anything (the interpreter, torch)
    built_rss: int = 0  # peak resident bytes once its stages are built, before the first step
    events: List[List[Any]] = field(default_factory=list)  # trace: [kind, micro-batch, stage, start, end]

    @property
    def pipeline_rank(self) -> int:
        return self.topology.pipeline_rank_of(self.rank)


def run(args) -> None:
    """One rank's whole run: join the group, build, train, write what it measured."""
    retain_freed_memory()  # as the profile did: no page faults for every micro-batch's buffers
    me = _start(args)
    me.start_rss = _current_rss()
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
        _check_same_plan(me.digest, me.rank, me.world)
        _build(me, use_tags=me.device.type != "cuda")
        if args.p2p == "auto" and args.engine == "own" and me.device.type == "cpu":
            _use_shared_memory(me)
        me.built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        first_step = _resume(me)
        link = _measure_link(me.plan, me.topology, me.rank, me.device, _local(me)) if args.measure_link else None
        host_kernel = [_time_host(me.device)]
        steps = _train(me, first_step)
        host_kernel.append(_time_host(me.device))
        _write_results(me, first_step, steps, link, host_kernel)
        dist.barrier()
    except BaseException as e:
        _write_error(args, e)  # before leaving the group: the others fail once it is gone, and the
        raise                  # launcher names the rank whose error file came first
    finally:
        if _reducer(me) is not None:
            _reducer(me).close()
        if _local(me) is not None:
            _local(me).close()
        dist.destroy_process_group()


def _start(args) -> _Rank:
    """Who this process is (RANK, WORLD_SIZE, LOCAL_RANK), the plan it runs, checked, and its device."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    os.makedirs(args.out_dir, exist_ok=True)
    plan = load_plan(args.plan)
    topology = plan.topology()
    # the lists `runtime execute` checks before starting; a torchrun launch checks them here
    check_schedule(plan.instruction_lists(), plan.num_micro_batches, placement=topology.rank_running)
    if world != topology.world_size:
        raise RuntimeError(f"the plan needs {topology.world_size} ranks ({topology.pipeline_ranks} pipeline x "
                           f"{topology.data_parallel} data-parallel) but {world} were started")
    if args.engine == "torch":
        from runtime.torch_engine import refusal  # imported only here: torch's pipelining slows every start

        if refusal(plan, args.precision):
            raise RuntimeError(refusal(plan, args.precision))
    threads = args.threads or int(plan.profile.get("threads", 1) or 1)
    torch.set_num_threads(threads)
    return _Rank(args, plan, topology, rank, world, _device_for(plan, local_rank), threads)


def _build(me: _Rank, use_tags: bool) -> None:
    """This rank's stages, process groups, optimizer and engine."""
    plan, topology, args = me.plan, me.topology, me.args
    me.init_state = InitState(args.init_state) if args.init_state else None
    me.optimizer_name = args.optimizer or plan.optimizer
    if me.optimizer_name == "adam":
        me.optimizer_name = "adamw"
    me.options = training_options(args, me.optimizer_name, plan)
    me.rank_model = build_rank(plan, topology, me.pipeline_rank, me.device, me.init_state,
                               unit_segments=plan.shard == "parameters",  # gathered per unit
                               autocast=me.options.autocast_dtype)
    for stage in me.rank_model.stages:
        stage.module.to(me.device)
    me.groups = Groups(topology, me.rank, me.rank_model.tied_groups, per_replica=plan.sync_every > 1)
    actions = plan.instruction_lists()[me.pipeline_rank]
    refused = run_refusal(plan, me.options, bool(args.checkpoint_dir))  # torchrun starts ranks unchecked
    if refused:
        raise ValueError(refused)
    tied = [param for param, _ in me.rank_model.tied.values()]
    if plan.shard == "parameters" and me.groups.data_parallel_group is not None:
        me.sharding = ParameterSharding(me.rank_model.stages, tied,
                                        me.groups.data_parallel_group, me.device)
        me.optimizer = me.sharding.optimizer_for(lambda params: make_optimizer(me.options, params))
    else:
        # issue 25: the plan's sharded optimizer state / gradients over this rank's replicas (runtime/shard.py)
        trainable = me.rank_model.trainable()
        sharded = shard_optimizer(plan.shard, *optimizer_arguments(me.options), trainable, tied,
                                  me.groups.data_parallel_group)
        me.optimizer = sharded or make_optimizer(me.options, trainable)

    def record(kind, i, g, t0, t1):  # wall-clock seconds
        me.events.append([kind, i, g, t0, t1])

    if args.engine == "torch":  # torch.distributed.pipelining runs the stages (runtime/torch_engine.py)
        from runtime.torch_engine import TorchEngine

        me.engine = TorchEngine(me.rank_model, plan, topology, me.rank, me.optimizer, me.device, me.groups,
                                trace=record if args.trace else None)
    else:
        me.engine = Engine(me.rank_model, actions, topology, me.rank, plan.global_batch, plan.num_micro_batches,
                           me.optimizer, me.device, me.groups, use_tags=use_tags,
                           trace=record if args.trace else None, autocast=me.options.autocast_dtype,
                           sync_every=plan.sync_every)
        me.engine.emulated_links = link_delays(plan)
        me.engine.emulated_exchange_s = exchange_delay(plan, topology.pipeline_rank_of(me.rank))
        if me.sharding is not None:
            me.sharding.exclude_gathered(me.engine.saved, lambda engine=me.engine: engine.count_saved)
    if me.options.clip_grad_norm is not None:
        me.engine.before_optimizer.append(_clipper(me))


def _resume(me: _Rank) -> int:
    """The first step to run: 0, or the last complete checkpoint's step with its state loaded.
    Rank 0 reads the marker and tells the others which step (-1: none; -2: it failed)."""
    args = me.args
    if not args.resume:
        return 0
    if not args.checkpoint_dir:
        raise RuntimeError("--resume needs --checkpoint-dir")
    chosen = torch.tensor([-1], dtype=torch.int64)  # on the CPU: gloo carries it (cpu:gloo,cuda:nccl on GPUs)
    failure: Optional[BaseException] = None
    if me.rank == 0:
        try:
            done = ckpt.latest(args.checkpoint_dir, me.digest, me.world)
            chosen[0] = -1 if done is None else done
        except BaseException as e:  # tell the others before failing
            chosen[0], failure = -2, e
    dist.broadcast(chosen, src=0)
    if failure is not None:
        raise failure
    done = int(chosen[0])
    if done == -2:
        raise RuntimeError("rank 0 could not read the checkpoint marker (its error says why)")
    if done < 0:
        return 0
    saved = ckpt.load_rank(args.checkpoint_dir, done, me.rank)
    for stage in me.rank_model.stages:
        stage.module.load_state_dict(saved["chunks"][str(stage.index)])
    me.optimizer.load_state_dict(saved["optimizer"])
    me.resumed_rng = saved.get("rng")  # set just before the first step (timing the host draws numbers too)
    return done


def _clipper(me: _Rank) -> GlobalNormClip:
    """Clipping by the global norm: this rank counts the gradients no other rank counts too."""
    topology = me.topology
    first = topology.replica_of(me.rank) == 0 and topology.lane_of(me.pipeline_rank) == 0
    tied_elsewhere = {id(param) for param, positions in me.rank_model.tied.values()
                      if min(positions) != me.pipeline_rank}
    params = me.rank_model.trainable()
    return GlobalNormClip(me.options.clip_grad_norm, params, [first and id(p) not in tied_elsewhere for p in params],
                          me.device, distributed=me.world > 1)


def _time_host(device: torch.device) -> Optional[float]:
    """The host's speed, timed by all ranks at once as they compute (CPU hosts only: shared cores
    are what drifts; on a GPU the kernel is not timed and no barriers are needed)."""
    if device.type != "cpu":
        return None
    dist.barrier()
    return reference_kernel_s(0.05, device=device)


def _train(me: _Rank, first_step: int) -> List[Dict[str, Any]]:
    """Steps first_step .. --steps, checkpointing every --checkpoint-every; each step's statistics."""
    args, topology, rank = me.args, me.topology, me.rank
    if me.device.type == "cpu":
        dist.barrier()  # every rank timed the host before any starts its steps
    is_reporter = me.pipeline_rank == topology.reporting_rank() and topology.replica_of(rank) == 0
    steps = []
    if me.resumed_rng is not None:
        ckpt.set_rng_state(me.resumed_rng)
    else:  # each rank's own random stream (runtime.streams)
        start_stream(int(me.plan.model.get("seed", 0)), rank, me.rank_model.built_rng_state)
    for step in range(first_step, args.steps):
        set_lr(me.optimizer, lr_at(me.options, step))
        stats = me.engine.run_step(step)
        if me.groups.data_parallel_group is not None and me.rank_model.stages[-1].is_last:
            stats.loss = _mean_over_holders(stats, me.groups, _reducer(me))
        steps.append(dict(stats.__dict__))
        if args.progress and is_reporter:
            print(f"step {step + 1}/{args.steps}  loss {stats.loss:.4f}  time {stats.time_s * 1e3:.1f} ms",
                  flush=True)
        if args.checkpoint_dir and args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0:
            ckpt.save_rank(args.checkpoint_dir, step + 1, rank,
                           {str(st.index): st.module.state_dict() for st in me.rank_model.stages},
                           me.optimizer.state_dict())
            dist.barrier()  # every rank's file is in place before the step is marked complete
            if rank == 0:
                ckpt.mark_complete(args.checkpoint_dir, step + 1, me.digest, me.world)
    return steps


def _write_results(me: _Rank, first_step: int, steps: List[Dict[str, Any]], link, host_kernel) -> None:
    """DIR/rank{R}.json (and the state with --save-state, the trace with --trace)."""
    args, topology, rank, m = me.args, me.topology, me.rank, me.plan.num_micro_batches
    pipeline_rank, stages = me.pipeline_rank, me.rank_model.stages
    peak = torch.cuda.max_memory_allocated(me.device) if me.device.type == "cuda" else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if me.sharding is not None:  # its shards and whole kept parameters, measured between steps
        static = me.sharding.resident_param_bytes()
    else:
        static = sum(p.numel() * p.element_size() for p in me.rank_model.parameters())  # each parameter once
    result = {"rank": rank, "pipeline_rank": pipeline_rank, "replica": topology.replica_of(rank),
              "lane": topology.lane_of(pipeline_rank), "chunks": [st.index for st in stages],
              "micro_batches": {str(st.index): len(topology.micro_batches_of(pipeline_rank, st.index, m))
                                for st in stages}, "threads": me.threads, "device": str(me.device),
              "optimizer": me.optimizer_name, "engine": args.engine, "first_step": first_step, "steps": steps, "peak_memory_bytes": peak, "peak_rss_bytes": rss,
              "start_rss_bytes": me.start_rss, "built_rss_bytes": me.built_rss,
              "peak_saved_bytes": me.engine.saved.peak, "param_bytes": static, "link": link,
              "host_kernel_s": host_kernel,
              # runtime/shared_memory.py: the ranks sharing this rank's /dev/shm (its messages to them went
              # through rings), and how many messages did
              "shared_memory_peers": sorted(_local(me).peers) if _local(me) else [],
              "shared_memory_messages": _local(me).messages if _local(me) else 0,
              # runtime/shared_reduce.py: how the gradient buckets were summed (None: the rank has none),
              # and how many through shared memory
              "gradient_all_reduce": _gradient_all_reduce(me),
              "shared_memory_reductions": _reducer(me).reductions if _reducer(me) else 0,
              "p2p_note": me.p2p_note,
              "precision_note": me.rank_model.precision_note}
    # sharded parameters are gathered by every holder (a collective), saved by one
    gathered = me.sharding.full_states() if me.sharding is not None and args.save_state else [None] * len(stages)
    if args.save_state and topology.replica_of(rank) == 0 and topology.lane_of(pipeline_rank) == 0:
        state: Dict[str, torch.Tensor] = {}
        for stage, module_state in zip(stages, gathered):
            state.update(stage_state(stage, me.rank_model.spec, me.init_state, module_state))
        with atomic_path(os.path.join(args.out_dir, f"rank{rank}.pt")) as tmp:
            torch.save(state, tmp)
    if args.trace:
        write_json_atomic(os.path.join(args.out_dir, f"rank{rank}.trace.json"), me.events)
    write_json_atomic(os.path.join(args.out_dir, f"rank{rank}.json"), result)


def _use_shared_memory(me: _Rank) -> None:
    """The engine's messages to the ranks of this host through shared memory, and its gradient
    buckets' all-reduce where its data-parallel group is on this host (runtime/shared_memory.py,
    runtime/shared_reduce.py). Collectives: every rank calls it, with a bound on what the host's
    rings and the all-reduce's files may take."""
    buckets = me.engine.buckets
    largest = max((flat.numel() * flat.element_size() for flat in buckets.buckets), default=0) if buckets else 0
    bound = ring_bytes(me.plan, me.world, me.args.measure_link and me.topology.pipeline_ranks > 1) + \
        (group_bytes(me.world, largest) if buckets is not None else 0)
    me.engine.local = connect(me.rank, me.world, me.args.timeout, bound)
    if buckets is not None:
        buckets.use_reducer(reducer(me.engine.local, me.groups.data_parallel_ranks, me.groups.data_parallel_group,
                                    largest))
    if me.engine.local is None and me.world > 1:
        why = (f"/dev/shm lacks room for the run's rings ({bound / 2**20:.0f} MiB) on some rank, or no other "
               "rank shares it" if available() else "shared memory needs x86 and a writable /dev/shm")
        me.p2p_note = f"messages through torch.distributed: {why}"


def _buckets(me: _Rank):
    """The rank's data-parallel gradient buckets (runtime/groups.py), or None (the torch engine has none)."""
    return getattr(me.engine, "buckets", None)


def _reducer(me: _Rank):
    """The rank's shared-memory gradient all-reduce (runtime/shared_reduce.py), or None."""
    return _buckets(me).reducer if _buckets(me) is not None else None


def _gradient_all_reduce(me: _Rank) -> Optional[str]:
    """How the rank's gradient buckets are summed; None where it has none."""
    if _buckets(me) is None or not _buckets(me).buckets:
        return None
    return "shared memory" if _reducer(me) is not None else "torch.distributed"


def _local(me: _Rank):
    """The rank's shared-memory transport (runtime/shared_memory.py), or None."""
    return getattr(me.engine, "local", None)  # the torch engine has none; the engine may not be built


LINK_PING_BYTES = 4 << 20  # the largest message of `_measure_link`, beside the plan's own sizes


def ring_bytes(plan: Plan, world: int, measure_link: bool) -> int:
    """A bound on what the run's shared-memory rings take on one host: each rank's rings to two peers,
    sized for the plan's largest message, and with `measure_link` the two rings of the link
    measurement's largest ping (`_measure_link`)."""
    largest = max(stage.activation_bytes_sent() for stage in plan.stages)
    return world * 2 * ring_size(largest) + (2 * ring_size(LINK_PING_BYTES) if measure_link else 0)


def _measure_link(plan: Plan, topology, rank: int, device: torch.device, local, repeats: int = 10):
    """Ping-pong between pipeline ranks 0 and 1 of replica 0 at the plan's cut sizes (and 8 B,
    4 MiB), fit as `planner profile --link measure` fits it: latency and bandwidth. Other ranks
    take no part. `local`: the shared-memory transport the run's messages take, or None."""
    if topology.pipeline_ranks < 2 or rank not in (0, 1):
        return None
    sizes = sorted({8, LINK_PING_BYTES} | {max(4, stage.activation_bytes_sent()) for stage in plan.stages[:-1]})
    samples = ping_pong(rank == 0, 1 - rank, sizes, repeats, warmup=2, tag=1 << 30, device=device,
                        post=poster(local) if local is not None else None)
    flat = {}
    try:
        fit = fit_link(samples)
    except ValueError:  # times did not grow with size (a loaded host): the bounding fit, marked flat
        try:
            fit, flat = bounding_link_fit(samples), {"flat": True}
        except ValueError:  # samples that are no times at all
            return None
    transport = "shared memory" if local is not None else ("nccl" if device.type == "cuda" else "gloo")
    return dict(fit, samples=samples, repeats=repeats, p2p=transport, **flat)


def _mean_over_holders(stats, groups: Groups, reducer=None):
    """Each holder of the last stage (data-parallel replicas, stage replicas) knows the mean loss
    of its own micro-batches; the step's loss is the mean over all of them. Summed through the
    gradient buckets' shared-memory `reducer` where the rank has one (the same group): a gloo
    collective between steps waits on the kernel's wake-ups, time no step's clock sees."""
    total = (stats.loss or 0.0) * stats.loss_count
    value = torch.tensor([total, float(stats.loss_count)], dtype=torch.float64)
    if reducer is not None:
        reducer.all_reduce(value, counted=False)
    else:
        dist.all_reduce(value, group=groups.data_parallel_group)
    return float(value[0] / value[1]) if value[1] > 0 else None


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
