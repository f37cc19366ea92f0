"""Profiling the way ranks run: round-robin timing, co-runner load, the measured link, and the
CLI flags and defaults that carry them into plans. No timing assertions: what is checked is what
was run, what was recorded and how the recorded numbers are used."""
import contextlib
import dataclasses
import io
import json
import os
import random

import pytest
import torch

from planner.cost.ranges import range_costs
from planner.profile.corunners import CoRunners
from planner.profile.link import FlatLinkError, bounding_link_fit, fit_link, fit_measured_link, measure_link
from planner.profile.hostspeed import host_drift, steadiest_profile
from planner.profile.measure import profile_model
from planner.profile.profile import Profile
from planner.profile.timing import UnitCall, measure_units, split_call_overhead, weight_walk
from runtime import shared_memory
from tests.support.runs import run_cli, run_here


# --- the link fit ----------------------------------------------------------------------------
_P2P = "shared memory" if shared_memory.available() else "gloo"  # what a CPU run's ranks of one host use

def test_fit_link_recovers_latency_and_bandwidth():
    latency, bandwidth = 1.2e-4, 2.0e9
    samples = [(n, latency + n / bandwidth) for n in (8, 16384, 65536, 1 << 20, 4 << 20)]
    fit = fit_link(samples)
    assert fit["latency_s"] == pytest.approx(latency, rel=1e-9)
    assert fit["bandwidth_bytes_per_s"] == pytest.approx(bandwidth, rel=1e-9)


def test_fit_link_weights_small_messages_like_large_ones():
    # the large message is 5 % slow; an unweighted fit would move the latency by tens of us,
    # the relative fit keeps the small messages (what pipeline cuts send) within a few percent
    latency, bandwidth = 1e-4, 2e9
    samples = [(n, latency + n / bandwidth) for n in (8, 16384, 32768)] + [(4 << 20, 1.05 * (latency + (4 << 20) / bandwidth))]
    fit = fit_link(samples)
    for n in (8, 16384, 32768):
        predicted = fit["latency_s"] + n / fit["bandwidth_bytes_per_s"]
        assert predicted == pytest.approx(latency + n / bandwidth, rel=0.03)


def test_fit_link_clamps_negative_latency_and_rejects_bad_samples():
    fit = fit_link([(1000, 0.5e-6), (2000, 1.5e-6)])  # the line would cross zero below 500 bytes
    assert fit["latency_s"] == 0.0 and fit["bandwidth_bytes_per_s"] > 0
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([(8, 1e-4), (8, 2e-4)])
    with pytest.raises(FlatLinkError, match="does not grow"):
        fit_link([(8, 2e-4), (4096, 1e-4)])
    with pytest.raises(ValueError, match="positive"):
        fit_link([(8, 0.0), (4096, 1e-4)])
    with pytest.raises(ValueError, match="finite"):
        fit_link([(8, 1e-4), (4096, float("inf"))])


# a loaded host: the 4 MiB round trip came back faster than the small ones
NOISY = [[8, 3e-4], [4096, 2.5e-4], [12288, 4e-4], [4 << 20, 2e-4]]
CLEAN = [[n, 1e-4 + n / 2e9] for n in (8, 4096, 12288, 4 << 20)]


def test_a_flat_link_is_measured_again_then_bounded_with_a_warning():
    measured = iter([{"samples": NOISY, "run": 1}, {"samples": CLEAN, "run": 2}])
    kept, fit, warning = fit_measured_link(lambda: next(measured), attempts=3)
    assert kept["run"] == 2 and warning is None  # the second measurement grew with size: fit as usual
    assert fit == fit_link(CLEAN)

    runs = []
    kept, fit, warning = fit_measured_link(lambda: runs.append(1) or {"samples": NOISY}, attempts=3)
    assert len(runs) == 3 and "did not grow with size in 3 measurement(s)" in warning
    assert fit == bounding_link_fit(NOISY)
    # latency from the smallest message, bandwidth floored at the largest message's whole time
    assert fit["latency_s"] == 3e-4 and fit["bandwidth_bytes_per_s"] == pytest.approx((4 << 20) / 2e-4)
    for n, t in (NOISY[0], NOISY[-1]):
        assert fit["latency_s"] + n / fit["bandwidth_bytes_per_s"] >= t

    with pytest.raises(ValueError, match="finite"):  # invalid samples are still an error, never retried
        fit_measured_link(lambda: runs.append(1) or {"samples": [[8, float("nan")], [4096, 1e-4]]}, attempts=3)
    assert len(runs) == 4


def _noisy_first_pair(rank, port, out):
    """One rank of test_a_flat_ping_pong_is_measured_again_alone: its first ping-pong comes back flat."""
    import datetime

    import torch.distributed as dist
    from planner.profile.link import measure_pair, ping_pong

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    pings = []

    def ping():
        pings.append(1)
        # the real one: the median of 5 round trips, so that a loaded host's stray spike cannot flatten it
        return NOISY if len(pings) == 1 else ping_pong(rank == 0, 1 - rank, [8, 4 << 20], 5, 1)

    config = {"repeats": 2, "warmup": 0, "attempts": 3, "allreduce_sizes": [1024], "allreduce_repeats": 1}
    measured = measure_pair(rank, config, ping)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(measured, pings_here=len(pings)), f)
    dist.destroy_process_group()


def test_a_flat_ping_pong_is_measured_again_alone(tmp_path):
    # in the same two processes, the ping-pong alone again (a flat one had re-run the whole
    # measurement, all-reduces and rhythm included, in two new processes)
    import torch.multiprocessing as mp
    from planner.profile.link import _free_port

    out = tmp_path / "pair.json"
    mp.spawn(_noisy_first_pair, args=(_free_port(), str(out)), nprocs=2)
    measured = json.loads(out.read_text())
    # the flat one was measured again in the same processes (a loaded host may flatten a real one too,
    # which is measured again as well: the count, not 2 exactly)
    assert measured["ping_pongs"] == measured["pings_here"] >= 2
    assert [n for n, _ in measured["samples"]] == [8, 4 << 20]
    if measured["warning"] is None:
        assert measured["fit"] == fit_link(measured["samples"])
    assert [k for k, _ in measured["batches"]] == [1, 8] and [n for n, _ in measured["allreduce"]] == [1024]


def test_measure_link_times_gloo_when_told():
    link = measure_link([4096], repeats=2, warmup=1, p2p="gloo")  # `runtime execute --p2p gloo`'s transport
    assert link["p2p"] == "gloo" and [n for n, _ in link["samples"]] == [8, 4096, 4 << 20]


def test_measure_link_pings_the_requested_sizes_between_two_processes():
    from planner.profile.link import fit_message_cost
    from planner.profile.rhythm import rhythm_latency, rhythm_message_cost

    link = measure_link([12288, 4096], repeats=3, warmup=1, rhythm=(2e-4, 4e-4))
    assert [n for n, _ in link["samples"]] == [8, 4096, 12288, 4 << 20]
    assert all(t > 0 for _, t in link["samples"])
    assert link["latency_s"] >= 0 and link["bandwidth_bytes_per_s"] > 0
    assert link["p2p"] == _P2P and link["repeats"] == 3  # the transport a CPU run's ranks use
    # batches of 1 and 8 tiny messages each way: the per-operation cost of a batch
    assert [k for k, _ in link["batches"]] == [1, 8] and all(t > 0 for _, t in link["batches"])
    assert link["transport_message_s"] == fit_message_cost(link["batches"]) >= 0
    # all-reduces of 1 MiB and of the runtime's gradient bucket: the rate at the bucket size
    from runtime.groups import GradientBuckets
    import inspect

    bucket = inspect.signature(GradientBuckets).parameters["bucket_bytes"].default
    reduced = link["allreduce"]
    assert [n for n, _ in reduced["samples"]] == [1 << 20, bucket] and all(t > 0 for _, t in reduced["samples"])
    assert reduced["bandwidth_bytes_per_s"] == pytest.approx(bucket / reduced["samples"][1][1])
    # the rhythm of a two-stage step's lists, recorded beside the ping-pong (planner.profile.rhythm)
    rhythm = link["rhythm"]
    assert rhythm["forward_s"] == 2e-4 and rhythm["backward_s"] == 4e-4 and rhythm["steps"] >= 5
    assert rhythm["step_s"] >= 9 * 6e-4  # (m + 1)(F + B) of compute at least
    # the plan's latency is the ping-pong's fit; the rhythm, run through the engine (runtime.message_rhythm), is read
    # as the per-operation cost with which the step graph of its lists takes its step, and charged where larger
    assert link["latency_s"] == pytest.approx(fit_link(link["samples"])["latency_s"])
    assert rhythm["latency_s"] == pytest.approx(rhythm_latency(rhythm["step_s"], 2e-4, 4e-4, rhythm["micro_batches"]))
    assert rhythm["message_s"] == pytest.approx(rhythm_message_cost(rhythm["step_s"], 2e-4, 4e-4, link["latency_s"],
                                                                    rhythm["micro_batches"]))
    assert link["message_s"] == max(link["transport_message_s"], rhythm["message_s"])


def test_the_all_reduce_rate_is_the_full_buckets():
    from planner.profile.link import all_reduce_rate

    assert all_reduce_rate([[1 << 20, 2e-3], [25 << 20, 10e-3]]) == pytest.approx((25 << 20) / 10e-3)
    with pytest.raises(ValueError, match="positive"):
        all_reduce_rate([[1 << 20, 0.0]])


def test_the_per_message_cost_is_the_slope_of_batch_time():
    from planner.profile.link import fit_message_cost

    # 1 message each way (2 operations per side) in 100 us, 8 each way (16) in 240 us: 10 us each
    assert fit_message_cost([[1, 100e-6], [8, 240e-6]]) == pytest.approx(10e-6)
    assert fit_message_cost([[8, 90e-6], [1, 100e-6]]) == 0.0  # noise never makes it negative
    with pytest.raises(ValueError, match="two sizes"):
        fit_message_cost([[4, 1e-4], [4, 2e-4]])


# --- round-robin unit timing -----------------------------------------------------------------
class _Logged(torch.nn.Module):
    def __init__(self, name, log):
        super().__init__()
        self.name, self.log = name, log
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        self.log.append(self.name)
        return (x * self.weight,)


def test_units_are_timed_round_robin_after_warmup():
    log = []
    units = [UnitCall(_Logged(name, log), [torch.ones(3, requires_grad=True)], [0], False) for name in "abc"]
    result = measure_units(units, None, None, torch.device("cpu"), repeats=4, warmup=2)
    assert len(result) == 3
    # one saved-bytes probe per unit, then 2 warm-up and 4 timed rounds over all units in turn
    assert log == ["a", "b", "c"] + ["a", "b", "c"] * 6
    assert all(t.forward_s > 0 and t.backward_s > 0 for t in result)


def test_minimum_time_adds_rounds_beyond_repeats():
    log = []
    units = [UnitCall(_Logged("a", log), [torch.ones(3, requires_grad=True)], [0], False)]
    measure_units(units, None, None, torch.device("cpu"), repeats=1, warmup=0, min_time_s=0.05)
    assert len(log) > 2  # the probe and one round would be 2; 50 ms of rounds are many more


# --- co-runners and what the profile records -------------------------------------------------
def test_profile_with_a_co_runner_records_its_conditions():
    alone = profile_model("builtin:mlp", {}, [2], repeats=1)
    shared = profile_model("builtin:mlp", {}, [2], repeats=1, co_runners=1, warmup_s=0.05, min_time_s=0.05)
    under = shared.extra["measured_under"]
    assert under["co_runners"] == 1 and under["order"] == "round-robin"
    assert under["warmup_s"] == 0.05 and under["min_time_s"] == 0.05 and under["threads"] == 1
    assert alone.extra["measured_under"]["co_runners"] == 0
    # the host-speed reference kernel, timed before and after (with the co-runner running it too)
    for host in (under["host_kernel"], alone.extra["measured_under"]["host_kernel"]):
        assert 0 < host["before_s"] < 1 and 0 < host["after_s"] < 1 and host["mean_s"] > 0
    # unit times are scaled to the whole model timed in the same rounds, per size (a wide range: with
    # the suite's two workers and the co-runner, three processes share two cores and 0.05 s rounds)
    scale = under["whole_model_scale"]["2"]
    assert set(scale) == {"forward", "backward"} and all(0.05 < x < 20.0 for x in scale.values())
    # what a stage pays once whatever it holds, kept apart from the units (see split_call_overhead)
    assert set(shared.stage_overhead_s) == {2} and all(x >= 0 for x in shared.stage_overhead_s[2])
    # what a split backward costs a stage on top of its units' parts (planner.cost.ranges): the first
    # stage's input part runs no autograd, so it costs less than a later one's
    first_input, later_input, later_weight = shared.split_overhead_s[2]
    assert set(shared.split_overhead_s) == {2} and min(first_input, later_input, later_weight) >= 0
    assert first_input < later_input + sum(u.backward_input_s[2] for u in shared.units[1:])
    # (each unit's weight part is fitted against whole stages: under load a small one can come out 0)
    trained = [u for u in shared.units if u.param_bytes]
    assert all(u.backward_input_s[2] >= 0 and u.backward_weight_s[2] >= 0 for u in trained)
    assert sum(u.backward_weight_s[2] for u in trained) > 0
    bare = profile_model("builtin:mlp", {}, [2], repeats=1, whole_model=False)
    assert bare.extra["measured_under"]["whole_model_scale"] is None and bare.stage_overhead_s == {}
    assert bare.split_overhead_s[2][1:] == (0.0, 0.0)  # units as timed alone: nothing kept apart
    # the load changes times, never what is counted
    assert [u.saved_bytes for u in shared.units] == [u.saved_bytes for u in alone.units]
    assert [u.param_bytes for u in shared.units] == [u.param_bytes for u in alone.units]
    again = Profile.from_json(json.loads(json.dumps(shared.to_json())))
    assert again.extra["measured_under"] == under and again.stage_overhead_s == shared.stage_overhead_s
    assert again.split_overhead_s == shared.split_overhead_s
    assert [u.shared_saved_bytes for u in again.units] == [u.shared_saved_bytes for u in shared.units]
    assert all(set(u.shared_saved_bytes) == {2} for u in shared.units)
    # one optimizer step per unit with parameters, for each optimizer the runtime runs; kept in the file
    for unit in shared.units:
        assert (set(unit.optimizer_s) == {"sgd", "adamw"} and all(t > 0 for t in unit.optimizer_s.values())) \
            if unit.param_bytes else unit.optimizer_s == {}
    assert [u.optimizer_s for u in again.units] == [u.optimizer_s for u in shared.units]
    # the weight part's calls and the autograd nodes they may walk, per unit (the first unit, which
    # never follows another in a stage, runs one whole backward: nothing analysed)
    assert [u.weight_calls for u in shared.units] == [u.weight_calls for u in again.units]
    assert all(u.weight_calls >= 1 and u.weight_walk_nodes > u.weight_calls for u in shared.units[1:] if u.param_bytes)
    assert again.weight_walk_s == shared.weight_walk_s and all(w > 0 for w in shared.weight_walk_s.values())
    total = sum(u.optimizer_s.get("adamw", 0.0) for u in shared.units)
    # what the cost model charges for one rank holding every unit
    assert range_costs(again, 2, "adam").step(0, again.num_units) == pytest.approx(total) and total > 0


def test_split_call_overhead_recovers_a_per_call_cost():
    # units of 1, 2, 3 ms each timed alone with a 0.5 ms call cost; the whole model pays it once
    split = split_call_overhead([1.5, 2.5, 3.5], 6.5)
    assert split.call_s == pytest.approx(0.5) and split.unit_s == pytest.approx([1.0, 2.0, 3.0])
    assert split.scale == pytest.approx(1.0)
    # a cost larger than the cheapest unit is capped there; the rest is spread in proportion
    split = split_call_overhead([0.2, 4.0, 4.0], 6.0)
    assert split.call_s == pytest.approx(0.2) and split.unit_s[0] == 0.0 and split.scale < 1
    assert sum(split.unit_s) + split.call_s == pytest.approx(6.0)
    # units that sum below the whole (noise) or a single unit: no call cost, proportional scaling
    for alone, whole in (([1.0, 2.0], 3.3), ([2.0], 1.8)):
        split = split_call_overhead(alone, whole)
        assert split.call_s == 0.0 and sum(split.unit_s) == pytest.approx(whole)
        assert split.scale == pytest.approx(whole / sum(alone))


def test_weight_walk_is_what_a_stage_pays_above_its_units_per_node_walked():
    # four units of 1 s alone, 2 calls and 10 nodes each; a stage pays c = 0.1 once and w = 0.01 per
    # node per call of its earlier units: [0, 4) walks 2 * (10 + 20 + 30) = 120 nodes, [2, 4) 20
    calls, nodes = [2] * 4, [10] * 4
    whole = lambda first: (4 - first) * 0.9 + 0.1 + 0.01 * 2 * 10 * sum(range(4 - first))  # noqa: E731
    units, walk = weight_walk([1.0] * 4, calls, nodes, [(0, whole(0)), (2, whole(2))])
    assert (units.call_s, walk) == pytest.approx((0.1, 0.01)) and units.unit_s == pytest.approx([0.9] * 4)
    # one stage alone: no per-stage cost told apart, the excess is all walk
    units, walk = weight_walk([1.0] * 4, calls, nodes, [(0, 4.0 + 1.2)])
    assert (units.call_s, walk) == pytest.approx((0.0, 0.01)) and units.unit_s == [1.0] * 4
    # no more than the units alone (noise, or only a per-stage cost: split_call_overhead's), or nothing walks
    assert weight_walk([1.0, 1.0], [2, 2], [10, 10], [(0, 1.9)]) is None
    assert weight_walk([1.0, 1.0], [2, 0], [10, 10], [(0, 2.5)]) is None


def test_inner_weight_bytes_round_trip_and_bad_values_are_refused():
    # what a unit holds more (less) where its stage computes values it reads (planner.cost.inner_weight):
    # by source unit, each a unit before it other than the first, never taking more than the unit holds
    from planner.jsonio import JsonFileError
    from tests.support.synthetic import random_chain

    p = random_chain(random.Random(0), 4, sizes=(2,))
    for u in p.units:
        u.backward_input_s, u.backward_weight_s, u.weight_held_bytes = {2: 1e-3}, {2: 1e-3}, {2: 100}
    p.units[3].inner_weight_bytes, p.units[3].inner_kept_bytes = {2: {"2": -60, "1": 30}}, {2: {"2": -70, "1": 10}}
    data = json.loads(json.dumps(p.to_json()))
    assert data["units"][3]["inner_weight_bytes"] == {"2": {"2": -60, "1": 30}}
    read = Profile.from_json(data).units[3]
    assert (read.inner_weight_bytes, read.inner_kept_bytes) == ({2: {"2": -60, "1": 30}}, {2: {"2": -70, "1": 10}})
    data["units"][3]["inner_kept_bytes"] = {"2": {"3": 8}}
    with pytest.raises(JsonFileError, match=r"inner_kept_bytes.*names unit '3'"):
        Profile.from_json(data)
    del data["units"][3]["inner_kept_bytes"]
    for bad, words in [({"2": {"0": 8}}, "names unit '0'"), ({"2": {"3": 8}}, "names unit '3'"),
                       ({"2": {"x": 8}}, "names unit 'x'"), ({"2": {"2": -101}}, "takes more than"),
                       ({"2": {"2": -60, "1": -41}}, "takes more than"), ({"2": {"1": 1.5e300}}, "byte counts"),
                       ({"2": {"1": "8"}}, "byte counts"), ({"2": [8]}, "expected an object")]:
        data["units"][3]["inner_weight_bytes"] = bad
        with pytest.raises(JsonFileError, match=words):
            Profile.from_json(data)
    # of its kept gradients, those of outputs made from its parameters alone: never more than all it keeps
    p.units[3].weight_kept_bytes = {2: 50}
    p.units[3].inner_seed_bytes = {2: {"x": 40}}
    data = json.loads(json.dumps(p.to_json()))
    assert Profile.from_json(data).units[3].inner_seed_bytes == {2: {"x": 40}}
    data["units"][3]["inner_seed_bytes"] = {"2": {"x": 51}}
    with pytest.raises(JsonFileError, match=r"inner_seed_bytes.*more than the unit's weight_kept_bytes"):
        Profile.from_json(data)
    # those made from values of a source before it too (inner_seed_sources) are in inner_kept_bytes, not in
    # weight_kept_bytes; a source is a unit before it, the first excepted
    data["units"][3]["inner_seed_sources"] = {"x": 2}
    assert Profile.from_json(data).units[3].inner_seed_sources == {"x": 2}
    assert Profile.from_json(json.loads(json.dumps(Profile.from_json(data).to_json()))).units[3].inner_seed_sources \
        == {"x": 2}
    for bad in (0, 3, -1):
        data["units"][3]["inner_seed_sources"] = {"x": bad}
        with pytest.raises(JsonFileError, match=r"inner_seed_sources|byte counts"):
            Profile.from_json(data)


def test_profile_stage_overhead_round_trips_and_bad_values_are_refused():
    from planner.jsonio import JsonFileError
    from tests.support.synthetic import synthetic_profile

    p = synthetic_profile(forward=[1.0, 1.0], backward=[2.0, 2.0], params=[0, 0], saved=[100, 100], cut_act=[8],
                          sizes=(1, 2), stage_overhead={1: (0.1, 0.2), 2: (0.15, 0.25)})
    data = json.loads(json.dumps(p.to_json()))
    assert data["stage_overhead_s"]["2"] == {"forward": 0.15, "backward": 0.25}
    assert Profile.from_json(data).stage_overhead(2) == (0.15, 0.25)
    assert Profile.from_json(data).stage_overhead(4) == (0.0, 0.0)  # unmeasured: none
    for bad in ({"1": {"forward": -1.0, "backward": 0.0}}, {"1": {"forward": 0.1}}, [0.1]):
        with pytest.raises(JsonFileError):
            Profile.from_json(dict(data, stage_overhead_s=bad))
    p.units[0].shared_saved_bytes = {2: {"x": 64}}
    data = json.loads(json.dumps(p.to_json()))
    assert Profile.from_json(data).units[0].shared_saved_bytes == {2: {"x": 64}}
    for bad in ({"2": {"x": -1}}, {"2": [64]}, {"two": {"x": 64}}, {"2": {"x": 10 ** 9}}):
        data["units"][0]["shared_saved_bytes"] = bad
        with pytest.raises(JsonFileError, match="shared_saved_bytes"):
            Profile.from_json(data)
    # a storage both name counts once; the shared ones and the rest dropped are more than the unit saved
    # (a fuzzed profile: a stage's weight part held -2.4 MB, and the plan solve wrote was refused on reading)
    saved = data["units"][0]["saved_bytes"]["2"]
    data["units"][0]["shared_saved_bytes"] = {"2": {"x": saved // 2}}
    data["units"][0]["dropped_saved_bytes"] = {"2": {"x": saved // 2, "": saved - saved // 2}}
    Profile.from_json(data)
    data["units"][0]["dropped_saved_bytes"] = {"2": {"": saved - saved // 2 + 1}}
    with pytest.raises(JsonFileError, match=r'dropped_saved_bytes\["2"\] .* more than the unit\'s saved_bytes'):
        Profile.from_json(data)
    del data["units"][0]["dropped_saved_bytes"]
    del data["units"][0]["shared_saved_bytes"]
    data["units"][0].update(backward_input_s={"1": 1.0, "2": 1.0}, backward_weight_s={"1": 1.0, "2": 1.0},
                            weight_held_bytes={"1": 8, "2": 8}, weight_kept_bytes={"1": 4, "2": 9})
    with pytest.raises(JsonFileError, match=r'weight_kept_bytes\["2"\] is 9: more than'):
        Profile.from_json(data)
    p.units[0].shared_saved_bytes = {}
    p.split_overhead_s = {2: (1e-5, 2e-5, 3e-5)}
    data = json.loads(json.dumps(p.to_json()))
    assert data["split_overhead_s"] == {"2": {"first_input": 1e-5, "input": 2e-5, "weight": 3e-5}}
    assert Profile.from_json(data).split_overhead_s == {2: (1e-5, 2e-5, 3e-5)}
    for bad in ({"2": {"first_input": 1e-5, "input": float("nan"), "weight": 0.0}}, {"2": {"input": 0.0}},
                {"x": {}}, [1e-5]):
        with pytest.raises(JsonFileError, match="split_overhead_s"):
            Profile.from_json(dict(data, split_overhead_s=bad))
    p.weight_walk_s = {2: 3e-7}
    p.units[1].weight_calls, p.units[1].weight_walk_nodes = 4, 90
    data = json.loads(json.dumps(p.to_json()))
    assert data["weight_walk_s"] == {"2": 3e-7} and data["units"][1]["weight_walk_nodes"] == 90
    again = Profile.from_json(data)
    assert again.weight_walk_s == {2: 3e-7} and (again.units[1].weight_calls, again.units[1].weight_walk_nodes) == (4, 90)
    assert (again.units[0].weight_calls, again.units[0].weight_walk_nodes) == (0, 0)  # not written: not measured
    for bad in ({"2": -1e-7}, {"2": float("inf")}, [3e-7]):
        with pytest.raises(JsonFileError, match="weight_walk_s"):
            Profile.from_json(dict(data, weight_walk_s=bad))
    data["units"][1]["weight_calls"] = -2
    with pytest.raises(JsonFileError, match=r"units\[1\].weight_calls"):
        Profile.from_json(data)


def test_the_engines_own_cost_is_added_to_every_stage_and_round_trips():
    import dataclasses

    from planner.cost.model import evaluate
    from planner.cost.options import CostOptions
    from planner.jsonio import JsonFileError
    from tests.support.synthetic import synthetic_profile

    p = synthetic_profile(forward=[1.0, 1.0], backward=[2.0, 2.0], params=[0, 0], saved=[0, 0], cut_act=[0],
                          sizes=(1,), stage_overhead={1: (0.1, 0.2)})
    opts = CostOptions(pipeline_ranks=2, global_batch=4, schedule="gpipe")
    before = evaluate(p, [1], 1, opts).iteration_s
    p = dataclasses.replace(p, engine_overhead_s=(0.01, 0.02))  # a new profile: costs are cached per profile
    assert p.stage_overhead(1) == pytest.approx((0.11, 0.22))
    # GPipe over 2 stages and 4 micro-batches: (m + p - 1) forwards and backwards on the longest path
    assert evaluate(p, [1], 1, opts).iteration_s == pytest.approx(before + 5 * 0.03)
    data = json.loads(json.dumps(p.to_json()))
    assert data["engine_overhead_s"] == {"forward": 0.01, "backward": 0.02}
    assert Profile.from_json(data).engine_overhead_s == (0.01, 0.02)
    assert "engine_overhead_s" not in synthetic_profile(forward=[1.0], backward=[1.0], params=[0], saved=[0],
                                                        cut_act=[], sizes=(1,)).to_json()  # unmeasured: absent
    for bad in ({"forward": -0.01, "backward": 0.0}, {"forward": "fast"}, [0.01]):
        with pytest.raises(JsonFileError, match="engine_overhead_s"):
            Profile.from_json(dict(data, engine_overhead_s=bad))


def _drifting(drifts):
    """A measure() whose successive profiles drifted by these fractions while 'measured'."""
    from tests.support.synthetic import synthetic_profile

    made = []

    def measure():
        p = synthetic_profile(forward=[1.0], backward=[2.0], params=[0], saved=[0], cut_act=[], sizes=(1,))
        drift = drifts[len(made)]
        p.extra["measured_under"] = {"host_kernel": {"before_s": 1e-4, "after_s": 1e-4 * (1 + drift)}}
        made.append(p)
        return p
    return measure, made


def test_a_profile_whose_host_speed_drifted_is_measured_again():
    measure, made = _drifting([0.3, 0.05, 0.0])
    said = []
    best = steadiest_profile(measure, retries=2, progress=said.append)
    assert best is made[1] and len(made) == 2 and best.extra["measured_under"]["attempts"] == 2
    assert host_drift(best) == pytest.approx(0.05) and "drifted 30 %" in said[0]
    # every attempt drifted: the steadiest is kept, and the user told
    measure, made = _drifting([0.3, 0.2, 0.25])
    said = []
    best = steadiest_profile(measure, retries=2, progress=said.append)
    assert best is made[1] and len(made) == 3 and "keeping the steadiest (20 %)" in said[-1]
    measure, made = _drifting([0.3])
    assert steadiest_profile(measure, retries=0) is made[0]
    # no reference kernel timed (a GPU, an older profile): nothing to compare, one attempt
    from tests.support.synthetic import synthetic_profile
    plain = synthetic_profile(forward=[1.0], backward=[2.0], params=[0], saved=[0], cut_act=[], sizes=(1,))
    assert host_drift(plain) == 0.0 and steadiest_profile(lambda: plain, retries=2) is plain


def test_co_runners_load_and_stop():
    co = CoRunners("builtin:mlp", {}, 0, 1, 1)
    co.load(2, settle_s=0.0)
    co.load(-1, settle_s=0.0)  # the reference kernel
    co.stop()
    assert all(p.returncode == 0 for p in co.processes)


def test_co_runners_need_a_cpu_profile():
    with pytest.raises(Exception, match="cpu only"):
        profile_model("builtin:mlp", {}, [2], device="cuda" if not torch.cuda.is_available() else "meta",
                      repeats=1, co_runners=1)


# --- the CLI ---------------------------------------------------------------------------------
def test_profile_cli_measures_the_link_and_solve_uses_it(tmp_path):
    path = str(tmp_path / "mlp.json")
    made = run_cli(["planner.cli", "profile", "builtin:mlp", "--micro-batch-sizes", "2", "--repeats", "1",
                    "--warmup", "0", "--min-time", "0", "--ranks-per-host", "2", "--retries", "0", "-o", path])
    assert made.returncode == 0, made.stderr
    assert "co-runner" in made.stdout and f"link ({_P2P}" in made.stdout
    assert "engine: " in made.stdout and "planner solve adds them to every stage" in made.stdout
    profile = json.load(open(path))
    assert set(profile["engine_overhead_s"]) == {"forward", "backward"}
    link = profile["link"]
    assert link["latency_s"] >= 0 and link["bandwidth_bytes_per_s"] > 0 and len(link["samples"]) >= 3
    assert profile["measured_under"]["co_runners"] == 1
    from planner.cli.main import main as planner_main

    plan_path = str(tmp_path / "plan.json")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert planner_main(["solve", path, "--stages", "2", "--global-batch", "4", "-o", plan_path]) == 0
    assert "measured link" in out.getvalue() and "all-reduce" in out.getvalue()
    assert "charged the runtime engine's own cost" in out.getvalue()
    plan = json.load(open(plan_path))
    assert plan["latency_s"] == pytest.approx(link["latency_s"])
    assert plan["bandwidth_bytes_per_s"] == pytest.approx(link["bandwidth_bytes_per_s"])
    # explicit options still win over the measured link
    with contextlib.redirect_stdout(io.StringIO()):
        assert planner_main(["solve", path, "--stages", "2", "--global-batch", "4", "--bandwidth", "1GB",
                             "--latency", "0.001", "-o", plan_path]) == 0
    plan = json.load(open(plan_path))
    assert plan["latency_s"] == 0.001 and plan["bandwidth_bytes_per_s"] == pytest.approx(1e9)


def test_profile_cli_link_none_and_bad_flags(tmp_path):
    path = str(tmp_path / "mlp.json")
    made = run_cli(["planner.cli", "profile", "builtin:mlp", "--micro-batch-sizes", "2", "--repeats", "1",
                    "--min-time", "0", "--link", "none", "--engine-cost", "none", "-o", path])
    assert made.returncode == 0, made.stderr
    assert "link" not in json.load(open(path)) and "engine_overhead_s" not in json.load(open(path))
    for bad, message in ((["--ranks-per-host", "0"], "at least 1"), (["--min-time", "-1"], "seconds"),
                         (["--ranks-per-host", str(os.cpu_count() + 1)], "more than the"),
                         (["--retries", "-1"], "0 or more"),
                         (["--device", "cuda", "--engine-cost", "measure"], "--engine-cost measure times the engine on "
                                                                             "the CPU")):
        result = run_here(["planner.cli", "profile", "builtin:mlp", *bad, "-o", path])
        assert result.returncode != 0 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_solve_link_defaults_prefer_options_then_calibration_then_the_measured_link():
    from planner.fidelity.calibrate import solve_link
    from tests.support.synthetic import synthetic_profile

    profile = synthetic_profile(forward=[{1: 1.0}] * 2, backward=[{1: 2.0}] * 2, params=[0, 0], saved=[{1: 0}] * 2,
                                cut_act=[{1: 8}], sizes=(1,))
    assert solve_link(profile)[:3] == (5e9, 0.0, 0.0)  # nothing measured: the defaults
    profile.extra["link"] = {"latency_s": 1e-4, "bandwidth_bytes_per_s": 2e9}
    bandwidth, latency, _, note, _, _ = solve_link(profile)
    assert (bandwidth, latency) == (2e9, 1e-4) and "measured link" in note
    profile.extra["calibration"] = {"latency_s": 5e-4, "bandwidth_bytes_per_s": 1e9, "step_overhead_s": 0.002}
    assert solve_link(profile)[:3] == (1e9, 5e-4, 0.002)  # a run's calibration beats the ping-pong
    assert solve_link(profile, 3e9, 0.0)[:2] == (3e9, 0.0)  # the user's options beat both
    assert solve_link(profile).message_s == 0.0
    profile.extra["link"]["message_s"] = 3e-5
    assert solve_link(profile).message_s == 3e-5 and "per message" in solve_link(profile).note
    assert solve_link(profile, message_s=1e-6).message_s == 1e-6
    # the data-parallel all-reduce: the measured rate unless --dp-bandwidth is given; none measured: None
    assert solve_link(profile).dp_bandwidth is None
    profile.extra["link"]["allreduce"] = {"bandwidth_bytes_per_s": 7e8, "samples": [[1 << 20, 1e-3]]}
    assert solve_link(profile).dp_bandwidth == 7e8 and "all-reduce" in solve_link(profile).note
    assert solve_link(profile, dp_bandwidth=1e9).dp_bandwidth == 1e9


def test_units_holding_batchnorm_are_marked_and_the_mark_round_trips():
    """planner.model.running_stats: the profile marks the units whose forward updates running
    statistics (the solver never replicates their stages: the runtime refuses that); the mark
    survives the file, older files read as unmarked, and a bad value is refused in one line."""
    from planner.jsonio import JsonFileError
    from tests.support.runs import profile_of

    marked = profile_of("builtin:resnet", {"inplace": True, "batchnorm": True}, sizes=(2,))  # test_buffers' profile
    # the stem is a bare convolution, the residual blocks hold BatchNorm, the head is a Linear
    assert [(u.name, u.running_stats) for u in marked.units] == [
        ("stem", False), ("layers.0", True), ("layers.1", True), ("layers.2", True), ("layers.3", True),
        ("fc", False)]
    data = json.loads(json.dumps(marked.to_json()))
    assert [u.running_stats for u in Profile.from_json(data).units] == [u.running_stats for u in marked.units]
    assert "running_stats" not in data["units"][0]  # written only where true
    del data["units"][1]["running_stats"]
    assert not Profile.from_json(data).units[1].running_stats
    data["units"][1]["running_stats"] = "yes"
    with pytest.raises(JsonFileError, match=r"units\[1\]\.running_stats"):
        Profile.from_json(data)


def test_a_failed_engine_probe_is_a_one_line_warning_and_the_profile_stands(monkeypatch, capsys):
    import argparse
    import subprocess

    from planner.cli import profile as profile_cli
    from planner.profile import engine_cost
    from tests.support.synthetic import synthetic_profile

    def probe(stdout, returncode=0, stderr=""):
        monkeypatch.setattr(engine_cost.subprocess, "run",
                            lambda *a, **k: subprocess.CompletedProcess(a, returncode, stdout, stderr))

    probe('{"forward_s": 2.5e-05, "backward_s": 1.5e-05}\n')
    assert engine_cost.measure_engine_overhead(1) == (2.5e-05, 1.5e-05)
    for printed, message in (("hello", "not its two times"), ('{"forward_s": -1, "backward_s": 0}', ">= 0")):
        probe(printed)
        with pytest.raises(RuntimeError, match=message):
            engine_cost.measure_engine_overhead(1)
    probe("", 1, "Traceback (most recent call last):\n  ...\nImportError: no runtime here")
    profile = synthetic_profile(forward=[1.0], backward=[1.0], params=[0], saved=[0], cut_act=[], sizes=(1,))
    profile_cli._engine_cost(argparse.Namespace(engine_cost=None, device="cpu", threads=1), profile)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: measuring the engine's own cost failed: ImportError: no runtime here; planner solve "
                   "charges no engine cost (--engine-cost none skips measuring it)"]
    assert profile.engine_overhead_s == (0.0, 0.0)


def test_a_profile_measured_under_bf16_mixed_says_so_in_its_file(tmp_path):
    """planner profile --precision bf16-mixed: the cut values have the run's dtypes, the precision is
    written (as schema_version 2: a planner reading version 1 only would scale its bytes again) and
    read back; a plain profile stays version 1 without the field; a bad value is refused in one line."""
    from planner.jsonio import JsonFileError

    path = str(tmp_path / "mixed.json")
    made = run_here(["planner.cli", "profile", "tests.models:normed_mlp", "--micro-batch-sizes", "2", "--repeats", "1",
                     "--min-time", "0", "--warmup", "0", "--link", "none", "--engine-cost", "none",
                     "--precision", "bf16-mixed", "-o", path])
    assert made.returncode == 0, made.stderr
    assert "under bf16-mixed" in made.stdout
    data = json.load(open(path))
    assert data["precision"] == "bf16-mixed" and data["schema_version"] == 2 and data["dtype"] == "float32"
    mixed = Profile.from_json(data)
    assert mixed.precision == "bf16-mixed" and "precision" not in mixed.extra
    assert {v.dtype for c in mixed.cuts for v in c.values} == {"bfloat16"}
    plain = Profile.from_json(json.loads(json.dumps(dataclasses.replace(mixed, precision=None).to_json())))
    assert plain.precision is None and "precision" not in plain.to_json() and plain.to_json()["schema_version"] == 1
    for bad, where in ((dict(data, precision="fp16"), "precision"), (dict(data, schema_version=1), "precision"),
                       (dict(data, schema_version=3), "schema_version 3")):
        with pytest.raises(JsonFileError, match=where):
            Profile.from_json(bad)
    refused = run_here(["planner.cli", "profile", "builtin:mlp", "--analytic", "--precision", "bf16-mixed",
                        "-o", str(tmp_path / "a.json")])
    assert refused.returncode == 2 and "--precision is for measured profiles" in refused.stderr
    solved = run_here(["planner.cli", "solve", path, "--stages", "2", "--global-batch", "8", "-o",
                       str(tmp_path / "plan.json")])
    assert solved.returncode == 0, solved.stderr
    assert json.load(open(tmp_path / "plan.json"))["precision"] == "bf16-mixed"  # the profile's, by default
    other = run_here(["planner.cli", "solve", path, "--stages", "2", "--global-batch", "8", "--precision", "fp32",
                      "-o", str(tmp_path / "plan32.json")])
    assert other.returncode == 2 and "measured under bf16-mixed" in other.stderr, other.stderr


def test_an_exported_model_profiles_under_bf16_mixed():
    # its graph takes the run's casts (planner.model.casts): the profile's gradient probe ran it with the
    # fp32 weights and no autocast, and a ViT stopped at its patch convolution (bf16 input, fp32 bias)
    pytest.importorskip("transformers")
    from planner.profile.measure import profile_model

    vit = {"image_size": 32, "patch_size": 8, "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
           "intermediate_size": 32}
    profile = profile_model("hf:ViTForImageClassification", vit, [2], repeats=1, precision="bf16-mixed",
                            whole_model=False)
    assert profile.precision == "bf16-mixed" and {v.dtype for c in profile.cuts for v in c.values} == {"bfloat16"}
