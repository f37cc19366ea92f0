"""A rank's set-up (runtime.worker): who this process is, the plan it runs (checked, and the same as
rank 0's), its device, its stages, process groups, optimizer and engine, and the step it resumes from."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from planner.pipeline.check import check_schedule
from planner.pipeline.topology import Topology
from planner.plan.file import Plan, load_plan
from planner.profile.subnormal import set_flushing
from runtime import checkpoint as ckpt
from runtime.emulation import exchange_delay, link_delays
from runtime.engine import Engine
from runtime.groups import Groups
from runtime.initstate import InitState
from runtime.options import run_refusal, training_options
from runtime.training import GlobalNormClip, TrainOptions, make_optimizer, optimizer_arguments
from runtime.shard import shard_optimizer
from runtime.shard_params import ParameterSharding
from runtime.stage import RankModel, build_rank


def current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def check_same_plan(digest: str, rank: int, world: int) -> None:
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
class RankProcess:
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


def start_rank(args) -> RankProcess:
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
    set_flushing(plan.flush_subnormals)  # the arithmetic the plan was timed on
    return RankProcess(args, plan, topology, rank, world, _device_for(plan, local_rank), threads)


def build_engine(me: RankProcess, use_tags: bool) -> None:
    """This rank's stages, process groups, optimizer and engine."""
    plan, topology, args = me.plan, me.topology, me.args
    me.init_state = InitState(args.init_state) if args.init_state else None
    me.optimizer_name = args.optimizer or plan.optimizer
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


def resume_step(me: RankProcess) -> int:
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
    ckpt.restore_rank(saved, me.rank_model.stages, me.optimizer, f"{args.checkpoint_dir!r} step {done} rank {me.rank}")
    me.resumed_rng = saved.get("rng")  # set just before the first step (timing the host draws numbers too)
    return done


def _clipper(me: RankProcess) -> GlobalNormClip:
    """Clipping by the global norm: this rank counts the gradients no other rank counts too."""
    topology = me.topology
    first = topology.replica_of(me.rank) == 0 and topology.lane_of(me.pipeline_rank) == 0
    tied_elsewhere = {id(param) for param, positions in me.rank_model.tied.values()
                      if min(positions) != me.pipeline_rank}
    params = me.rank_model.trainable()
    return GlobalNormClip(me.options.clip_grad_norm, params, [first and id(p) not in tied_elsewhere for p in params],
                          me.device, distributed=me.world > 1)
