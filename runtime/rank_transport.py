"""The transport of a rank's messages and gradient all-reduce (runtime.worker): shared memory between
the CPU ranks of one host where it can (runtime/shared_memory.py, runtime/shared_reduce.py), else
torch.distributed; and the link measured over it (--measure-link)."""
from __future__ import annotations

from typing import Optional

import torch

from planner.plan.file import Plan
from planner.profile.link import bounding_link_fit, fit_link, ping_pong
from runtime.link_probe import poster
from runtime.rank_setup import RankProcess
from runtime.shared_memory import available, connect, ring_size
from runtime.shared_reduce import group_bytes, reducer


def use_shared_memory(me: RankProcess) -> None:
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
    use_tie_reducers(me)
    if me.engine.local is None and me.world > 1:
        why = (f"/dev/shm lacks room for the run's rings ({bound / 2**20:.0f} MiB) on some rank, or no other "
               "rank shares it" if available() else "shared memory needs x86 and a writable /dev/shm")
        me.p2p_note = f"messages through torch.distributed: {why}"


def use_tie_reducers(me: RankProcess) -> None:
    """Each tied weight's gradient sum through shared memory where its holders share this host, as
    the data-parallel buckets' (a gloo all-reduce sleeps in the kernel and is woken late: about 1-2 ms
    for BERT's 1 MiB tied embedding on a 2-core host, where the plan charges the shared-memory
    all-reduce's 0.16 ms). Every holder of a tie calls `reducer` for it, in the plan's order of ties."""
    groups, tied = me.groups, me.rank_model.tied
    for k, (name, _) in enumerate(me.rank_model.tied_groups):
        if name not in groups.tie_groups or name not in tied:
            continue
        param = tied[name][0]
        made = reducer(me.engine.local, groups.tie_ranks[name], groups.tie_groups[name],
                       param.numel() * param.element_size(), kind=f"tie{k}")
        if made is not None:
            groups.tie_reducers[name] = made


def close_tie_reducers(me: RankProcess) -> None:
    groups = getattr(me, "groups", None)
    for made in (getattr(groups, "tie_reducers", None) or {}).values():
        made.close()


def _buckets(me: RankProcess):
    """The rank's data-parallel gradient buckets (runtime/groups.py), or None (the torch engine has none)."""
    return getattr(me.engine, "buckets", None)


def shared_reducer(me: RankProcess):
    """The rank's shared-memory gradient all-reduce (runtime/shared_reduce.py), or None."""
    return _buckets(me).reducer if _buckets(me) is not None else None


def gradient_all_reduce(me: RankProcess) -> Optional[str]:
    """How the rank's gradient buckets are summed; None where it has none."""
    if _buckets(me) is None or not _buckets(me).buckets:
        return None
    return "shared memory" if shared_reducer(me) is not None else "torch.distributed"


def tie_all_reduce(me: RankProcess) -> Optional[str]:
    """How the rank's tied weights' gradients are summed; None where it holds no tie."""
    groups = getattr(me, "groups", None)
    if groups is None or not groups.tie_groups:
        return None
    return "shared memory" if all(name in groups.tie_reducers for name in groups.tie_groups) else "torch.distributed"


def shared_transport(me: RankProcess):
    """The rank's shared-memory transport (runtime/shared_memory.py), or None."""
    return getattr(me.engine, "local", None)  # the torch engine has none; the engine may not be built


LINK_PING_BYTES = 4 << 20  # the largest message of `measure_rank_link`, beside the plan's own sizes


def ring_bytes(plan: Plan, world: int, measure_link: bool) -> int:
    """A bound on what the run's shared-memory rings take on one host: each rank's rings to two peers,
    sized for the plan's largest message, and with `measure_link` the two rings of the link
    measurement's largest ping (`measure_rank_link`)."""
    largest = max(stage.activation_bytes_sent() for stage in plan.stages)
    return world * 2 * ring_size(largest) + (2 * ring_size(LINK_PING_BYTES) if measure_link else 0)


def measure_rank_link(plan: Plan, topology, rank: int, device: torch.device, local, repeats: int = 10):
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
