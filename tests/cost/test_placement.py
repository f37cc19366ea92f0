"""Placements on a leveled topology (planner.cost.placement): what the cost model sees of them —
each boundary at the link it crosses, the data-parallel exchange hierarchical — and the search's
enumeration, one placement per cost signature."""
import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.cost.placement import Placement, identity_placement, placements
from planner.cost.topology_file import topology_from_json
from tests.support.synthetic import synthetic_profile

IN, OUT = 1e9, 1e7  # bytes/s inside a site, across sites
TWO_BY_TWO = {"levels": [{"name": "site", "count": 2, "bandwidth": OUT, "latency": 0.02, "emulate": True},
                         {"name": "device", "count": 2, "bandwidth": IN, "latency": 0.0}]}
PARAMS = 1 << 20  # per unit


def _profile(L=4):
    return synthetic_profile([0.001] * L, [0.002] * L, [PARAMS] * L, [0] * L, [1 << 10] * (L - 1), sizes=(1,))


def _exchange(devices, topology=TWO_BY_TWO, **kw):
    """rank 0's exchange seconds and the part of them the runtime holds for the emulated site link,
    under a placement of p = 1 or 2."""
    topo = topology_from_json(topology)
    placement = Placement(topo, devices)
    p, d = placement.pipeline_ranks, placement.data_parallel
    opts = CostOptions(pipeline_ranks=p, global_batch=4 * d, data_parallel=d, placement=placement, **kw)
    cost = evaluate(_profile(), [2] if p == 2 else [], 1, opts)
    seconds = cost.durations[("reduce", 0)]
    return seconds, placement.emulated_exchange(0, seconds, opts.latency)


def test_hierarchical_exchange():
    T = 4 * PARAMS  # one rank holds the whole model (p = 1): 4 units of fp32 gradients
    RING = 2 * 0.02  # two rings (reduce-scatter, all-gather) of one step each across the 2 sites
    # 4 holders over 2 sites of 2: reduce-scatter and all-gather inside (2 (k-1)/k T / IN), the 1/k share across
    seconds, held = _exchange(((0,), (1,), (2,), (3,)))
    inside, across = 2 * (1 / 2) * T / IN, 2 * (1 / 2) * (T / 2) / OUT
    assert seconds == pytest.approx(inside + across + RING)
    assert held == pytest.approx(across + RING)
    # a flat ring over the slow link would cost 2 (3/4) T / OUT: the hierarchy sends less across
    assert seconds < 2 * 0.75 * T / OUT + RING
    # p = 2: a rank's two holders in one site exchange at the inner link only; across sites, all over the slow one
    half = 2 * PARAMS
    inner, held = _exchange(((0, 2), (1, 3)))
    assert inner == pytest.approx(2 * 0.5 * half / IN) and held == 0
    outer, held = _exchange(((0, 1), (2, 3)))
    assert outer == pytest.approx(2 * 0.5 * half / OUT + RING) and held == pytest.approx(outer)
    # levels without a bandwidth (latency) take --dp-bandwidth (--latency) for the exchange
    bare = {"levels": [dict(TWO_BY_TWO["levels"][0]), {"name": "device", "count": 2}]}
    default, _ = _exchange(((0,), (1,), (2,), (3,)), bare, dp_bandwidth=2e9, latency=0.001)
    assert default == pytest.approx(2 * 0.5 * T / 2e9 + across + RING + 2 * 0.001)


def test_three_levels_recurse():
    topo = {"levels": [{"name": "site", "count": 2, "bandwidth": 1e7}, {"name": "host", "count": 2, "bandwidth": 1e8},
                       {"name": "device", "count": 2, "bandwidth": 1e9}]}
    seconds, _ = _exchange(tuple((i,) for i in range(8)), topo)
    T = 4 * PARAMS
    # devices in a host, then hosts in a site (a 1/2 share), then sites (a 1/4 share)
    expected = 2 * 0.5 * T / 1e9 + 2 * 0.5 * (T / 2) / 1e8 + 2 * 0.5 * (T / 4) / 1e7  # no latencies given
    assert seconds == pytest.approx(expected)


def test_each_boundary_costs_the_link_it_crosses_in_the_slowest_replica():
    topo = topology_from_json(TWO_BY_TWO)
    opts = CostOptions(pipeline_ranks=4, global_batch=4, placement=Placement(topo, ((0, 2, 3, 1),)))
    message = (1 << 10) / OUT + 0.02
    cost = evaluate(_profile(), [1, 2, 3], 1, opts)
    assert [cost.durations[("act", j)] for j in range(3)] == pytest.approx([message, (1 << 10) / IN, message])
    # 2 sites x 3: replica 1 crosses at boundary 0 where replica 0 does not, and replica 0 at boundary 1
    six = topology_from_json({"levels": [TWO_BY_TWO["levels"][0], dict(TWO_BY_TWO["levels"][1], count=3)]})
    mixed = Placement(six, ((0, 1, 3), (2, 4, 5)))
    assert mixed.path(0, 1, 1.0, 0.0) == (OUT, 0.02) and mixed.path(1, 2, 1.0, 0.0) == (OUT, 0.02)
    assert mixed.emulated(0, 1) and mixed.emulated(1, 2)
    inside = Placement(six, ((0, 1, 2), (3, 4, 5)))
    assert inside.path(0, 1, 1.0, 0.0) == (IN, 0.0) and not inside.emulated(1, 2)


def test_speed_and_memory_are_the_slowest_replicas():
    topo = topology_from_json(dict(TWO_BY_TWO, device={"memory": 1000}, devices={"3": {"speed": 0.5, "memory": 500}}))
    placement = Placement(topo, ((0, 1), (2, 3)))
    assert [placement.speed(i) for i in range(2)] == [1.0, 0.5]
    assert [placement.memory(i, None) for i in range(2)] == [1000, 500]


def test_placements_are_enumerated_once_per_signature():
    topo = topology_from_json(TWO_BY_TWO)
    deep = placements(topo, 4, 1)
    # which boundaries cross sites: {1}, {0, 1, 2} or {0, 2}
    assert [pl.devices for pl in deep] == [((0, 1, 2, 3),), ((0, 2, 1, 3),), ((0, 2, 3, 1),)]
    # p = 2, d = 2: pipelines inside sites (exchange across), across (exchange inside), both across
    assert len(placements(topo, 2, 2)) == 3 and len(placements(topo, 1, 4)) == 1
    assert deep[0] == identity_placement(topo, 4, 1)
    with pytest.raises(ValueError, match="at most 8"):
        placements(topology_from_json({"levels": [{"count": 3}, {"count": 3}]}), 3, 3)
    with pytest.raises(ValueError, match="each of the topology's 4 devices once"):
        CostOptions(pipeline_ranks=2, global_batch=4, data_parallel=2,
                    placement=Placement(topo, ((0, 1), (1, 3)))).validate()
    with pytest.raises(ValueError, match="the placement has 2 replica"):
        CostOptions(pipeline_ranks=4, global_batch=4, placement=Placement(topo, ((0, 1), (2, 3)))).validate()


def test_a_rank_holding_only_frozen_units_pays_no_exchange_latency():
    """The runtime runs no collective for a rank with nothing trainable (runtime.groups: no bucket;
    runtime.shard: no sharded optimizer), so neither its rings' latency nor an emulated hold is
    charged -- except under ZeRO-3, whose gathers of the frozen weights are an exchange."""
    import dataclasses

    from planner.plan.make import emulated_exchange_s

    topo = topology_from_json(TWO_BY_TWO)
    profile = synthetic_profile([0.001] * 4, [0.002] * 4, [PARAMS] * 4, [0] * 4, [1 << 10] * 3,
                                cut_grad=[0, 0, 1 << 10], sizes=(1,))  # no gradient crosses the frozen front
    profile = dataclasses.replace(profile, units=[dataclasses.replace(u, trainable_bytes=0 if k < 2 else PARAMS)
                                                  for k, u in enumerate(profile.units)])
    opts = CostOptions(pipeline_ranks=2, global_batch=8, data_parallel=2, placement=Placement(topo, ((0, 1), (2, 3))))
    RING = 2 * 0.02  # each rank's two holders sit in different sites
    cost = evaluate(profile, [2], 1, opts)  # rank 0: the two frozen units
    assert cost.durations[("reduce", 0)] == 0.0
    assert cost.durations[("reduce", 1)] == pytest.approx(2 * 0.5 * 2 * PARAMS / OUT + RING)
    assert emulated_exchange_s(opts, cost.durations)[0] == 0.0
    assert evaluate(profile, [1], 1, opts).durations[("reduce", 0)] == 0.0
    # one trainable unit on the rank: the whole latency
    assert evaluate(profile, [3], 1, opts).durations[("reduce", 0)] == pytest.approx(2 * 0.5 * PARAMS / OUT + RING)
    zero3 = evaluate(profile, [2], 1, opts.with_(shard="parameters")).durations
    # m (n-1)/n w for the forwards, m = 4, and one ring's latency per gather: each frozen unit's forward
    assert zero3[("reduce", 0)] == pytest.approx(0.5 * 4 * 2 * PARAMS / OUT + 4 * 2 * RING / 2)


def test_zero3_under_a_placement_pays_a_ring_per_collective_the_runtime_issues():
    """ZeRO-3 gathers each unit per micro-batch for its forward, again for its backward where that runs,
    and reduce-scatters a trainable unit's gradients (runtime.shard_params; counted by the gather spy in
    tests/runtime/test_shard_params.py): each of them waits one ring's latency, half the exchange's two."""
    import dataclasses

    from planner.plan.make import emulated_exchange_s

    topo = topology_from_json(TWO_BY_TWO)
    profile = synthetic_profile([0.001] * 4, [0.002] * 4, [PARAMS] * 4, [0] * 4, [1 << 10] * 3, sizes=(1,))
    profile = dataclasses.replace(profile, units=[dataclasses.replace(u, trainable_bytes=0 if k < 2 else PARAMS)
                                                  for k, u in enumerate(profile.units)])  # gradients cross every cut
    opts = CostOptions(pipeline_ranks=2, global_batch=8, data_parallel=2, shard="parameters",
                       placement=Placement(topo, ((0, 1), (2, 3))))
    ring, m = 0.02, 4  # each holder pair crosses the site link (0.02 s) once per ring
    durations = evaluate(profile, [2], 1, opts).durations
    # rank 0: unit 0 frozen, its backward not run (1 gather); unit 1 frozen, its input carries a
    # gradient (2 gathers); rank 1: units 2, 3 trained (2 gathers and a reduce-scatter each)
    bytes_0 = 0.5 * (m * 2 * PARAMS + m * PARAMS) / OUT
    assert durations[("reduce", 0)] == pytest.approx(bytes_0 + m * 3 * ring)
    bytes_1 = 0.5 * m * 2 * 3 * PARAMS / OUT
    assert durations[("reduce", 1)] == pytest.approx(bytes_1 + m * 6 * ring)
    # the runtime holds the emulated site link's share after its exchange, every ring's latency included:
    # one rank of 4 replicas, two per site (its bytes partly on the emulated site link, partly inside)
    one = CostOptions(pipeline_ranks=1, global_batch=8, data_parallel=4, shard="parameters",
                      placement=Placement(topo, ((0,), (1,), (2,), (3,))))
    seconds, rings = evaluate(profile, [], 1, one).durations[("reduce", 0)], 2 * (1 + 2 + 3 + 3)  # m = 2
    h = 1 / (2 * IN) + 1 / (4 * OUT)  # seconds per byte of the hierarchical exchange (planner.cost.placement)
    assert seconds == pytest.approx(rings * PARAMS * h + rings * ring)  # each collective moves a unit's weights
    bytes_share = 1 / (4 * OUT) / h
    assert emulated_exchange_s(one, {("reduce", 0): seconds}, [rings])[0] == pytest.approx(
        (seconds - rings * ring) * bytes_share + rings * ring)
