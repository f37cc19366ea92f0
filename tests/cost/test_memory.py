"""Memory by precision, optimizer and sharding (issue 25): bytes per parameter against a hand count,
the data-parallel traffic, the reserve, and the cost model and solvers using them."""
import dataclasses

import pytest

from planner.cost.memory import bytes_per_param, default_reserve, sync_bytes_per_param
from planner.cost.model import compute_profile, evaluate
from planner.cost.options import CostOptions
from planner.solve.api import solve
from planner.solve.diagnose import InfeasibleError
from planner.solve.search import expand_scenarios
from tests.support.synthetic import synthetic_profile

# Bytes per parameter on each of 4 holders, counted by hand: (params + bf16 copy) + grads + optimizer
# (AdamW: two moments; SGD: none), the optimizer state / 4 from ZeRO-1, gradients / 4 from ZeRO-2,
# parameters / 4 (copy made per gathered unit) from ZeRO-3.
HAND = {
    ("fp32", "adamw"): {"none": 4 + 4 + 8, "optimizer": 4 + 4 + 2, "gradients": 4 + 1 + 2, "parameters": 1 + 1 + 2},
    ("bf16-mixed", "adamw"): {"none": 4 + 2 + 4 + 8, "optimizer": 4 + 2 + 4 + 2, "gradients": 4 + 2 + 1 + 2,
                              "parameters": 1 + 1 + 2},
    ("bf16", "adamw"): {"none": 2 + 2 + 4, "optimizer": 2 + 2 + 1, "gradients": 2 + 0.5 + 1,
                        "parameters": 0.5 + 0.5 + 1},
    ("fp32", "sgd"): {"none": 8, "optimizer": 8, "gradients": 4 + 1, "parameters": 1 + 1},
    ("bf16-mixed", "sgd"): {"none": 10, "optimizer": 10, "gradients": 4 + 2 + 1, "parameters": 1 + 1},
    ("bf16", "sgd"): {"none": 4, "optimizer": 4, "gradients": 2 + 0.5, "parameters": 0.5 + 0.5},
}


@pytest.mark.parametrize("precision,optimizer", sorted(HAND))
def test_bytes_per_param_match_a_hand_count(precision, optimizer):
    for shard, expected in HAND[precision, optimizer].items():
        assert bytes_per_param(precision, optimizer, shard, holders=4).total == expected, shard
        # one holder shards nothing
        assert bytes_per_param(precision, optimizer, shard, holders=1).total == HAND[precision, optimizer]["none"]
    assert bytes_per_param(precision, "adam").total == bytes_per_param(precision, "adamw").total


def test_sync_bytes_per_shard():
    # fp32, 4 holders, 8 micro-batches: ring all-reduce 2 (n-1)/n g; ZeRO-1 reduce-scatter + all-gather
    # (the same bytes); ZeRO-2 a reduce-scatter per micro-batch; ZeRO-3 also two gathers per micro-batch
    assert sync_bytes_per_param("fp32", "none", 4, 8) == 2 * 0.75 * 4
    assert sync_bytes_per_param("fp32", "optimizer", 4, 8) == 0.75 * (4 + 4)
    assert sync_bytes_per_param("fp32", "gradients", 4, 8) == 0.75 * (8 * 4 + 4)
    assert sync_bytes_per_param("fp32", "parameters", 4, 8) == 0.75 * 8 * (4 + 2 * 4)
    assert sync_bytes_per_param("bf16", "none", 4, 8) == 2 * 0.75 * 2
    assert sync_bytes_per_param("fp32", "gradients", 1, 8) == 0.0


def test_unknown_words_are_refused_in_one_line():
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        bytes_per_param("fp16", "adamw")
    with pytest.raises(ValueError, match="unknown shard"):
        CostOptions(pipeline_ranks=1, global_batch=1, shard="zero9").validate()
    with pytest.raises(ValueError, match="unknown precision"):
        CostOptions(pipeline_ranks=1, global_batch=1, precision="half").validate()


def test_default_reserve_by_device():
    assert default_reserve("cpu") == 0
    assert default_reserve("cuda:0") == 2.5 * 2 ** 30
    assert default_reserve("analytic", {"name": "h100"}) == 2.5 * 2 ** 30
    assert default_reserve("analytic", {"name": "h100", "reserve_bytes": 123}) == 123
    assert default_reserve("analytic", {"name": "cpu-calibrated"}) == 0


PARAMS = [4000, 8000, 8000, 4000]  # bytes, fp32: 1000, 2000, 2000, 1000 parameters


def _profile(dtype="float32"):
    profile = synthetic_profile(forward=[1e-3] * 4, backward=[2e-3] * 4, params=PARAMS, saved=[400] * 4,
                                cut_act=[80] * 3, sizes=(1, 2))
    if dtype != "float32":  # the same model profiled in half precision: every byte count halved
        profile = dataclasses.replace(profile, dtype="float32")
        profile = compute_profile(profile, CostOptions(1, 1, precision="bf16"))
    return profile


def _opts(**kw):
    base = dict(pipeline_ranks=2, global_batch=8, data_parallel=2, optimizer="adamw", dp_bandwidth=1e6)
    base.update(kw)
    return CostOptions(**base)


def test_device_memory_counts_the_precision_and_shard():
    profile = _profile()
    none = evaluate(profile, [2], 2, _opts(precision="fp32"))
    # stage 0: 3000 parameters, fp32 AdamW 16 B each
    st = none.stages[0]
    assert (st.param_bytes, st.grad_bytes, st.optimizer_bytes) == (12000, 12000, 24000)
    held = none.device_memory[0] - 3000 * 16  # activations and received messages: the list's peak
    assert held >= st.activation_bytes > 0
    for shard, per in (("optimizer", 4 + 4 + 4), ("gradients", 4 + 2 + 4), ("parameters", 2 + 2 + 4)):
        cost = evaluate(profile, [2], 2, _opts(precision="fp32", shard=shard))
        # two of the largest unit gathered, and its whole gradients until reduce-scattered
        gathered = 2 * 2000 * 4 + 2000 * 4 if shard == "parameters" else 0
        assert cost.device_memory[0] == 3000 * per + gathered + held, shard
    mixed = evaluate(profile, [2], 2, _opts(precision="bf16-mixed"))
    # 18 B per parameter; activations and messages computed in bf16: half the fp32 profile's
    assert mixed.device_memory[0] == 3000 * 18 + held / 2
    assert mixed.stages[0].param_bytes == 3000 * 6


def test_a_half_precision_profile_defaults_to_bf16_mixed():
    half = _profile("bfloat16")
    assert half.dtype == "bfloat16" and half.units[0].param_bytes == 2000
    cost = evaluate(half, [2], 2, _opts())
    same = evaluate(_profile(), [2], 2, _opts(precision="bf16-mixed"))
    assert cost.device_memory == same.device_memory and cost.stages[0].param_bytes == 3000 * 6


def test_sharded_exchange_is_charged():
    profile = _profile()
    m = 2  # micro-batches per replica at b = 2, G = 8, d = 2
    for shard, per in (("none", 2 * 0.5 * 4), ("optimizer", 0.5 * 8), ("gradients", 0.5 * (m * 4 + 4))):
        cost = evaluate(profile, [2], 2, _opts(precision="fp32", shard=shard))
        assert cost.durations[("reduce", 0)] == pytest.approx(3000 * per / 1e6), shard


def test_reserve_is_kept_free():
    profile = _profile()
    cost = evaluate(profile, [2], 2, _opts(precision="fp32", reserve_bytes=1000))
    plain = evaluate(profile, [2], 2, _opts(precision="fp32"))
    assert cost.device_memory[0] == plain.device_memory[0] + 1000
    cap = plain.device_memory[0] + 500
    assert evaluate(profile, [2], 2, _opts(precision="fp32", memory_cap=cap)).feasible
    assert not evaluate(profile, [2], 2, _opts(precision="fp32", memory_cap=cap, reserve_bytes=1000)).feasible


@pytest.mark.parametrize("method", ["ilp", "dp", "brute"])
def test_solvers_respect_static_memory_and_choose_the_shard(method):
    profile = _profile()
    need = evaluate(profile, [2], 1, _opts(precision="fp32", recompute="none")).device_memory
    cap = max(need) - 1  # unsharded, no split of these 2 stages fits (stage halves are the smallest)
    opts = _opts(precision="fp32", memory_cap=cap, recompute="none")
    with pytest.raises(InfeasibleError):
        solve(profile, opts, method=method)
    found = solve(profile, opts.with_(shard="auto"), method=method)
    assert found.options.shard != "none" and found.cost.feasible
    assert max(found.cost.device_memory) <= cap
    fixed = solve(profile, opts.with_(shard="optimizer"), method=method)
    assert fixed.options.shard == "optimizer" and max(fixed.cost.device_memory) <= cap


def test_auto_shard_chooses_only_what_the_runtime_runs():
    """16 units of 1 MiB parameters on 2 x 2 devices under 12 MB: only parameters sharded (ZeRO-3) fits.
    1F1B in fp32 takes it; zero-bubble and bf16-mixed plans sharding parameters the runtime refuses, so
    `--shard auto` no longer chooses them there (it wrote such a plan with a note that it does not run), nor
    for a profile with a unit passing on a view of its parameter."""
    profile = synthetic_profile([1e-3] * 16, [2e-3] * 16, [1 << 20] * 16, [1000] * 16, [100] * 15)
    opts = CostOptions(pipeline_ranks=2, data_parallel=2, global_batch=8, shard="auto", precision="fp32",
                       recompute="none", memory_cap=12e6, optimizer="sgd")
    assert solve(profile, opts, method="brute").options.shard == "parameters"
    for refused in (opts.with_(schedule="zb-h1"), opts.with_(precision="bf16-mixed")):
        assert solve(profile, refused.with_(memory_cap=None), method="brute").options.shard != "parameters"
        with pytest.raises(InfeasibleError):
            solve(profile, refused, method="brute")
    from planner.cost.topology_file import topology_from_json
    from planner.solve.placed import solve_on_topology

    four = topology_from_json({"levels": [{"name": "device", "count": 4, "bandwidth": "10GB"}]})
    placed = opts.with_(pipeline_ranks=4, data_parallel=1)  # on a topology too: p x d = 4 chosen there
    assert solve_on_topology(profile, placed, four, pipeline_ranks=2).options.shard == "parameters"
    with pytest.raises(InfeasibleError):
        solve_on_topology(profile, placed.with_(schedule="zb-h1"), four, pipeline_ranks=2)
    profile.units[3].parameter_view = True  # a unit passing on a view of its parameter (planner.model.parameter_views)
    with pytest.raises(InfeasibleError):
        solve(profile, opts, method="brute")


def test_auto_shard_enumerates_shards_only_with_replicas():
    opts = _opts(shard="auto")
    shards = {(o.data_parallel, o.shard) for o in expand_scenarios(opts, 4, devices=4)}
    assert (1, "none") in shards and not any(d == 1 and s != "none" for d, s in shards)
    assert {s for d, s in shards if d == 2} == {"none", "optimizer", "gradients", "parameters"}
    with pytest.raises(ValueError, match="concrete shard"):
        evaluate(_profile(), [2], 2, opts)


def test_a_profile_planned_in_another_precision_scales_every_activation_count():
    # fp32 profile planned at bf16: saved bytes were halved but the counts the ranges subtract from
    # them (shared storages, the model's inputs, the weight part's held bytes) stayed in fp32 bytes,
    # which made a stage's held bytes 0 or negative (a plan its own loader refused)
    import random

    from tests.support.synthetic import random_chain, share_saved

    p = synthetic_profile([1e-3] * 3, [2e-3] * 3, [1000] * 3, [400, 800, 400], [400] * 2, sizes=(1,))
    share_saved(p, [1, 2])  # 1600 saved, 800 of them shared by neighbours: 800 held, 400 in bf16
    for precision, held in (("fp32", 800), ("bf16-mixed", 400), ("bf16", 400)):
        opts = CostOptions(pipeline_ranks=1, global_batch=1, precision=precision)
        assert evaluate(p, [], 1, opts).stages[0].activation_bytes == held
    p = synthetic_profile([1e-3] * 3, [2e-3] * 3, [1000] * 3, [400, 800, 400], [400] * 2, sizes=(1,))
    share_saved(p, [1, 2])
    p.units[-1].loss_saved_bytes = {1: 200}  # of the last unit's 400: fp32 under bf16-mixed, not under bf16
    for precision, held in (("bf16", 400), ("bf16-mixed", 500), ("bf16", 400)):  # each its own conversion
        opts = CostOptions(pipeline_ranks=1, global_batch=1, precision=precision)
        assert evaluate(p, [], 1, opts).stages[0].activation_bytes == held, precision
    for seed in range(12):
        rng = random.Random(seed)
        profile = random_chain(rng, 6, sizes=(1, 2))
        for unit in profile.units:  # the zero-bubble counts as `planner profile` measures them
            for b in profile.micro_batch_sizes:
                unit.backward_input_s[b], unit.backward_weight_s[b] = unit.backward_s[b] / 2, unit.backward_s[b] / 2
                unit.weight_held_bytes[b] = rng.randint(0, unit.saved_bytes[b])
                unit.weight_kept_bytes[b] = rng.randint(0, unit.weight_held_bytes[b])
                unit.first_saved_bytes[b] = unit.saved_bytes[b] + rng.randint(0, 1000)
        profile.units[-1].loss_saved_bytes = {b: 4096 * b for b in profile.micro_batch_sizes}
        for schedule, stages, v in (("1f1b", 3, 1), ("gpipe", 3, 1), ("interleaved", 2, 2), ("zb-h1", 3, 1)):
            for recompute in ("none", "all"):
                split = sorted(rng.sample(range(1, 6), stages * v - 1))
                base = CostOptions(pipeline_ranks=stages, global_batch=8, schedule=schedule, virtual_stages=v,
                                   recompute=recompute)
                full = evaluate(profile, split, 2, base)
                half = evaluate(profile, split, 2, base.with_(precision="bf16"))  # bf16-mixed keeps the loss fp32
                for a, h in zip(full.stages, half.stages):  # every count halved, each rounded down
                    assert 0 <= a.activation_bytes / 2 - h.activation_bytes <= 64, (seed, schedule, recompute)


def test_a_profile_measured_under_bf16_mixed_keeps_its_activations():
    # planner profile --precision bf16-mixed measured every activation count as the run holds it: a plan
    # at bf16-mixed (the default for such a profile) takes them as measured, converts only its parameter
    # bytes, and a plan at another precision is refused (which tensors autocast kept in fp32 is not known)
    fp32 = _profile()
    measured = dataclasses.replace(fp32, precision="bf16-mixed")
    scaled = evaluate(fp32, [2], 2, _opts(precision="bf16-mixed"))
    for opts in (_opts(), _opts(precision="bf16-mixed")):
        cost = evaluate(measured, [2], 2, opts)
        for a, s in zip(cost.stages, scaled.stages):
            assert (a.param_bytes, a.grad_bytes, a.optimizer_bytes) == (s.param_bytes, s.grad_bytes, s.optimizer_bytes)
            assert a.activation_bytes == 2 * s.activation_bytes > 0
    converted = compute_profile(measured, _opts())
    assert converted.dtype == "bfloat16" and converted.precision == "bf16-mixed"
    assert converted.units[0].saved_bytes == fp32.units[0].saved_bytes
    assert converted.cuts[0].values[0].bytes == fp32.cuts[0].values[0].bytes
    for precision in ("fp32", "bf16"):
        with pytest.raises(ValueError, match="measured under bf16-mixed"):
            evaluate(measured, [2], 2, _opts(precision=precision))
