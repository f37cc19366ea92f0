"""A tied weight costs one copy per rank (planner.cost.ties), on a real capture whose units both count it."""
import dataclasses
import functools

import pytest

from planner.cost import memory as memory_model
from planner.cost.model import evaluate, precision_of, static_bytes, sync_time
from planner.cost.options import CostOptions
from planner.profile.analytic import DeviceSpec
from planner.profile.analytic_profile import analytic_profile

FLAT = DeviceSpec(name="test", peak_flops={"float32": 1e12}, memory_bandwidth=1e11, efficiency=0.5)
TIE = 64 * 16 * 4  # tied_lm's embedding (vocab 64 x dim 16, fp32), also its head's weight
BLOCK = 1088  # one of its three blocks


@functools.lru_cache(maxsize=1)
def tied_profile():
    """tests.models:tied_lm captured on the meta device, each unit's optimizer step timed at 1 ms per KiB."""
    profile = analytic_profile("tests.models:tied_lm", {}, [1], FLAT)
    units = [dataclasses.replace(u, optimizer_s={"sgd": u.trainable_bytes / 1024 * 1e-3}) for u in profile.units]
    return dataclasses.replace(profile, units=units)


def untied(profile):
    return dataclasses.replace(profile, extra=dict(profile.extra, shared_parameters=[]))


def options(p=1, d=1, schedule="1f1b", v=1):
    return CostOptions(pipeline_ranks=p, data_parallel=d, global_batch=4 * d, schedule=schedule, virtual_stages=v,
                       reserve_bytes=0)


def test_the_capture_counts_the_tie_in_both_units_it_uses():
    profile = tied_profile()
    assert [(u.name, u.trainable_bytes) for u in profile.units] == \
        [("emb", TIE), ("blocks.0", BLOCK), ("blocks.1", BLOCK), ("blocks.2", BLOCK), ("head", TIE)]
    assert profile.extra["shared_parameters"][0]["units"] == ["emb", "head"]
    assert profile.extra["shared_parameters"][0]["bytes"] == TIE


@pytest.mark.parametrize("d", [1, 2])
def test_one_rank_holds_and_steps_one_copy_and_exchanges_it_once(d):
    # before the fix: static memory of 2 TIE + 3 BLOCK (28676 bytes at d = 1 against 20484), the
    # exchange and the step of both copies
    profile, opts = tied_profile(), options(d=d)
    cost, counted = evaluate(profile, [], 1, opts), evaluate(untied(profile), [], 1, opts)
    unique = TIE + 3 * BLOCK
    assert cost.device_memory[0] == counted.device_memory[0] - static_bytes(TIE, TIE, opts, profile.dtype)
    assert cost.durations[("reduce", 0)] == pytest.approx(sync_time(unique, unique, 0, opts, profile.dtype, 4))
    assert cost.durations[("step", 0)] == pytest.approx(unique / 1024 * 1e-3)
    assert cost.collectives == ()
    assert cost.stages[0].param_bytes == cost.stages[0].grad_bytes == unique  # the plan file's stage figures


def test_a_tie_spanning_ranks_leaves_the_data_parallel_exchange():
    # before the fix: each rank exchanged its copy of the tie on top of the tie's own all-reduce
    profile, opts = tied_profile(), options(p=2, d=2)
    cost, counted = evaluate(profile, [2], 1, opts), evaluate(untied(profile), [2], 1, opts)
    assert cost.device_memory == counted.device_memory  # one copy on each rank: nothing counted twice
    for i, own in enumerate([BLOCK, 2 * BLOCK]):  # emb, blocks.0 | blocks.1, blocks.2, head
        assert cost.durations[("reduce", i)] == pytest.approx(sync_time(own, own, 0, opts, profile.dtype, 4))
    assert cost.durations[("step", 0)] == pytest.approx((TIE + BLOCK) / 1024 * 1e-3)
    assert [term for term, _ in cost.collectives] == [("tie", "emb.weight")]


def test_zb_v_holds_one_copy_where_the_first_and_last_stages_share_a_rank():
    profile, opts = tied_profile(), options(p=2, d=2, schedule="zb-v", v=2)
    cost, counted = evaluate(profile, [1, 2, 4], 1, opts), evaluate(untied(profile), [1, 2, 4], 1, opts)
    assert cost.device_memory[0] == counted.device_memory[0] - static_bytes(TIE, TIE, opts, profile.dtype)
    assert cost.device_memory[1] == counted.device_memory[1]
    own = TIE  # rank 0 runs stages 0 (emb) and 3 (head): one copy, not spanning, exchanged in its buckets
    assert cost.durations[("reduce", 0)] == pytest.approx(sync_time(own, own, 0, opts, profile.dtype, 4))
    assert cost.durations[("step", 0)] == pytest.approx(own / 1024 * 1e-3)
    assert cost.collectives == ()


def test_local_sgd_averages_the_copy_each_rank_holds_even_where_the_tie_spans_ranks():
    # the model averaging covers every trainable parameter a rank holds (runtime.localsgd), tie or not
    profile = tied_profile()
    opts = CostOptions(pipeline_ranks=2, data_parallel=2, global_batch=8, sync_every=3, reserve_bytes=0)
    cost = evaluate(profile, [2], 1, opts)
    for i, own in enumerate([TIE + BLOCK, 2 * BLOCK + TIE]):
        assert cost.durations[("reduce", i)] == pytest.approx(sync_time(own, own, 0, opts, profile.dtype, 4))
    assert [term for term, _ in cost.collectives] == [("tie", "emb.weight")]


@pytest.mark.parametrize("shard, boundaries, whole", [
    ("optimizer", [2], [False, False]),  # ZeroRedundancyOptimizer shards the tie's state with the rest
    ("gradients", [2], [True, True]),  # spanning: kept out of the owners' shares, every holder steps it
    ("gradients", [], [False]),  # on one rank: one parameter among the others, sharded
    ("parameters", [2], [True, True]),  # spanning: kept out of FSDP2's shards
    ("parameters", [], [True]),  # two units of the rank read it: kept whole too (runtime.shard_params)
])
def test_a_tie_the_runtime_keeps_whole_under_zero_is_counted_whole(shard, boundaries, whole):
    # before the fix every copy was counted sharded over the d = 2 replicas (runtime/shard.py,
    # runtime/shard_params.py keep these whole: tests/runtime/test_shard_params.py measures it)
    profile = tied_profile()
    opts = dataclasses.replace(options(p=len(boundaries) + 1, d=2), shard=shard, optimizer="adamw")
    cost, counted = evaluate(profile, boundaries, 1, opts), evaluate(untied(profile), boundaries, 1, opts)
    excess = static_bytes(TIE, TIE, opts, profile.dtype, 1) - static_bytes(TIE, TIE, opts, profile.dtype)
    assert excess > 0
    extra = [static_bytes(TIE, TIE, opts, profile.dtype)] if not boundaries else [0.0, 0.0]  # one rank: 2 uses
    for i, kept in enumerate(whole):
        assert cost.device_memory[i] == pytest.approx(counted.device_memory[i] - extra[i] + (excess if kept else 0.0),
                                                      rel=1e-12)


@pytest.mark.parametrize("shard, boundaries, whole", [
    ("none", [2], [False, False]),
    ("none", [], [False]),
    ("optimizer", [], [False]),
    ("gradients", [2], [True, True]),
    ("parameters", [2], [True, True]),
    ("parameters", [], [True]),
])
def test_the_plan_files_stage_figures_count_a_tie_kept_whole_as_the_rank_does(shard, boundaries, whole):
    # before the fix the per-stage figures (planner.plan.make writes them) counted the copy sharded
    # where device_memory counts it whole: 8192 bytes short at parameters, d = 2, one rank
    profile = tied_profile()
    opts = dataclasses.replace(options(p=len(boundaries) + 1, d=2), shard=shard, optimizer="adamw")
    cost, counted = evaluate(profile, boundaries, 1, opts), evaluate(untied(profile), boundaries, 1, opts)
    itemsize = memory_model.param_itemsize(profile.dtype)
    sharded, kept = (memory_model.bytes_per_param(precision_of(opts, profile.dtype), "adamw", shard, n)
                     for n in (2, 1))
    extra = 1 if not boundaries else 0  # one rank: its two uses counted, one held
    for g, (stage, untied_stage) in enumerate(zip(cost.stages, counted.stages)):
        assert stage.memory_bytes - untied_stage.memory_bytes == pytest.approx(
            cost.device_memory[g] - counted.device_memory[g], abs=1e-6)  # one stage per rank
        excess = kept if whole[g] else sharded  # the held copy's bytes per parameter
        for figure, per in [("param_bytes", "weights"), ("grad_bytes", "grads")]:
            want = getattr(untied_stage, figure) + TIE / itemsize * (
                getattr(excess, per) - (1 + extra) * getattr(sharded, per))
            assert getattr(stage, figure) == pytest.approx(want, abs=1), figure
        assert stage.optimizer_bytes == pytest.approx(untied_stage.optimizer_bytes + TIE / itemsize * (
            excess.master + excess.optimizer - (1 + extra) * (sharded.master + sharded.optimizer)), rel=1e-12)


@functools.lru_cache(maxsize=1)
def frozen_tied_profile():
    """tests.models:frozen_tied_lm (the tied embedding and blocks.0 frozen) captured on the meta device."""
    return analytic_profile("tests.models:frozen_tied_lm", {}, [1], FLAT)


def test_zero3_all_reduces_a_tie_its_rank_keeps_whole_once_a_step_and_gathers_none_of_it():
    # One rank, d = 2, m = 4, fp32 (g = w = 4 B a parameter), 1 MB/s: the runtime keeps the tie whole
    # (runtime.shard_params: two of the rank's units read it) and all-reduces its gradient once a step,
    # 2 (d - 1)/d g = 4 B a parameter = 1 per byte; each block is gathered for every forward and
    # backward and reduce-scattered, m (d - 1)/d (g + 2 w) = 24 B a parameter = 6 per byte.
    # Before the fix: one copy of the tie was charged as gathered, 6 (3 BLOCK + TIE) = 44160 us.
    opts = options(d=2).with_(shard="parameters", dp_bandwidth=1e6)
    cost = evaluate(tied_profile(), [], 1, opts)
    assert cost.durations[("reduce", 0)] == pytest.approx((6 * 3 * BLOCK + TIE) / 1e6)
    # frozen: emb (the tie) and blocks.0 frozen, neither's backward runs: blocks.0 gathered for its
    # forwards, m (d - 1)/d w = 2 per byte; the tie never. Before: its forward gathers in emb and head
    # and head's backward gathers, 6 TIE more (39808 us)
    cost = evaluate(frozen_tied_profile(), [], 1, opts)
    assert cost.durations[("reduce", 0)] == pytest.approx((2 * BLOCK + 6 * 2 * BLOCK) / 1e6)


def test_zero3_still_gathers_a_frozen_tie_with_one_use_per_rank():
    # p = 2: emb, blocks.0 | blocks.1, blocks.2, head. Each rank holds one use of the frozen tie and
    # shards it (runtime.stage: a frozen weight is no tie): rank 0 gathers emb and blocks.0 for its
    # forwards (2 per byte, m = 4), rank 1 the head for its forwards and backwards too (4 per byte)
    opts = options(p=2, d=2).with_(global_batch=8, shard="parameters", dp_bandwidth=1e6)
    cost = evaluate(frozen_tied_profile(), [2], 1, opts)
    assert cost.durations[("reduce", 0)] == pytest.approx(2 * (TIE + BLOCK) / 1e6)
    assert cost.durations[("reduce", 1)] == pytest.approx((6 * 2 * BLOCK + 4 * TIE) / 1e6)
