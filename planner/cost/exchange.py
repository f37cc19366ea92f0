"""The data-parallel exchange's time: a pipeline rank's gradient all-reduce (or its sharded exchanges,
or local SGD's averaging) over its replicas, per step, and the latency of its rings under a topology
placement (planner.cost.placement). The step graph charges it as the rank's `reduce` action; a tied
weight's all-reduce over the ranks using it as its `tie` action."""
from __future__ import annotations

from typing import Optional, Tuple

from planner.cost import memory as memory_model
from planner.cost.localsgd import averaging_seconds_per_byte, buffer_averaging_seconds_per_byte
from planner.cost.options import CostOptions
from planner.cost.rank_memory import _shard, precision_of


def sync_factors(opts: CostOptions, dtype: str, m: int, holders: Optional[int] = None,
                 rank: Optional[int] = None) -> Tuple[float, float]:
    """Seconds of the data-parallel exchange per trainable and per frozen profile byte (per pass of
    gathers: forwards, and backwards where they run) over n
    holders (default the d replicas) at dp_bandwidth, m micro-batches per replica (planner.cost.memory);
    under local SGD its model averaging's share of a step (planner.cost.localsgd). Under a topology
    placement, the d replicas of pipeline `rank` exchange hierarchically (planner.cost.placement: its
    effective bandwidth; rank None: the fastest rank's)."""
    n, bandwidth = _exchange_link(opts, holders, rank)
    if opts.local_sgd:  # the model averaging every H steps, charged 1/H per step; frozen: nothing
        return averaging_seconds_per_byte(precision_of(opts, dtype), n, dtype, bandwidth) / opts.sync_every, 0.0
    precision, scale = precision_of(opts, dtype), memory_model.param_itemsize(dtype) * bandwidth
    return (memory_model.sync_bytes_per_param(precision, _shard(opts), n, m) / scale,
            memory_model.frozen_gather_bytes_per_param(precision, _shard(opts), n, m) / scale)


def _exchange_link(opts: CostOptions, holders: Optional[int], rank: Optional[int]) -> Tuple[int, float]:
    """(n holders, bandwidth) of a data-parallel exchange (`sync_factors`)."""
    n = opts.data_parallel if holders is None else holders
    bandwidth = opts.dp_bandwidth if opts.dp_bandwidth is not None else opts.bandwidth
    if opts.placement is not None and holders is None:
        bandwidth = opts.placement.exchange_bandwidth(rank, bandwidth)
    return n, bandwidth


def sync_time(param_bytes, trainable_bytes, frozen_backward_bytes, opts: CostOptions, dtype: str, m: int,
              holders: Optional[int] = None, rank: Optional[int] = None, buffer_bytes=0.0):
    """Seconds of the data-parallel exchange for parameters of `param_bytes` profile bytes of which
    `trainable_bytes` train and, of the frozen ones, `frozen_backward_bytes` belong to units whose
    backward runs (numbers or numpy arrays; planner.cost.ranges): frozen ones have no gradient to
    exchange; under ZeRO-3 every one is gathered for the forwards, those for the backwards again.
    Under local SGD the averaging also all-reduces the `buffer_bytes` of floating-point buffers."""
    trainable, frozen = sync_factors(opts, dtype, m, holders, rank)
    seconds = trainable * trainable_bytes + frozen * (param_bytes - trainable_bytes + frozen_backward_bytes)
    if opts.local_sgd:
        n, bandwidth = _exchange_link(opts, holders, rank)
        seconds = seconds + buffer_averaging_seconds_per_byte(n, bandwidth) / opts.sync_every * buffer_bytes
    return seconds


def exchange_latency(opts: CostOptions, rank: int) -> float:
    """Seconds of latency of pipeline rank's data-parallel exchange per step when it exchanges
    anything: its rings' under a topology placement with d > 1 (planner.cost.placement), else none
    (bandwidth-bound); under ZeRO-3 none (its collectives' latency is per collective: `reduce_time`)."""
    if opts.placement is None or opts.shard == "parameters":
        return 0.0
    return opts.placement.exchange_latency(rank, opts.latency)


def collective_latency(opts: CostOptions, rank: int) -> float:
    """Seconds of latency of one ZeRO-3 collective (an all-gather or a reduce-scatter) of pipeline
    rank's holders under a topology placement: one of the two rings of its exchange's latency
    (planner.cost.placement); 0 elsewhere."""
    if opts.placement is None or opts.shard != "parameters":
        return 0.0
    return opts.placement.exchange_latency(rank, opts.latency) / 2


def whole_reduce_time(whole_bytes, opts: CostOptions, dtype: str, rank: Optional[int] = None):
    """Seconds of the all-reduce, once per step over pipeline rank's d replicas, of `whole_bytes`
    trainable profile bytes that ZeRO-3 keeps whole (planner.cost.ties: a tie two of the rank's
    units use), 2 (d - 1)/d of the gradient, as the plain exchange sends (numbers or numpy arrays)."""
    n, bandwidth = _exchange_link(opts, None, rank)
    per_byte = memory_model.sync_bytes_per_param(precision_of(opts, dtype), "none", n, 1)
    return per_byte / (memory_model.param_itemsize(dtype) * bandwidth) * whole_bytes


def reduce_time(param_bytes: float, trainable_bytes: float, frozen_backward_bytes: float, opts: CostOptions,
                dtype: str, m: int, rank: int, collectives: float = 0.0, buffer_bytes: float = 0.0,
                whole_bytes: float = 0.0) -> float:
    """Seconds of pipeline rank's data-parallel exchange per step: its bytes (`sync_time`) and, only
    when it moves any, its rings' latency. A rank with nothing to exchange (every parameter frozen,
    no ZeRO-3 gathers) runs no collective (runtime.groups: no bucket, no sharded optimizer). Under
    ZeRO-3 the latency is per collective the runtime issues: `collectives` per micro-batch (its units'
    planner.cost.ranges `sharded_collectives`), m micro-batches a step; `whole_bytes`: the trainable
    bytes it keeps whole, all-reduced once a step (`whole_reduce_time`; bandwidth only). `buffer_bytes`:
    its units' floating-point buffers, which local SGD averages."""
    seconds = sync_time(param_bytes, trainable_bytes, frozen_backward_bytes, opts, dtype, m, rank=rank,
                        buffer_bytes=buffer_bytes)
    if whole_bytes:
        seconds += whole_reduce_time(whole_bytes, opts, dtype, rank)
    seconds += m * collectives * collective_latency(opts, rank)
    return seconds + exchange_latency(opts, rank) if seconds > 0 else 0.0


def tie_time(bytes_: int, holders: int, opts: CostOptions) -> float:
    """All-reduce of a tied weight over n holding ranks: 2 (n - 1) / n bytes / bandwidth (0 when n = 1)."""
    return 2.0 * (holders - 1) / holders * bytes_ / opts.bandwidth if holders > 1 else 0.0
