"""Views of one storage that a stage receives apart (planner.cost.received): what the cost model counts against
a reference that holds each storage once, the storage whole inside a stage holding its maker, its views each in
a storage of their own in a stage starting after it."""
import itertools
import json
import random

import numpy as np
import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.cost.ranges import RangeCosts
from planner.profile.profile import Profile
from planner.solve.diagnose import memory_matrices
from tests.support.synthetic import synthetic_profile, views_apart

L = 5


def _chain(seed: int, parts: int = 2):
    """(profile, holders): L units, a storage that unit 0 makes crossing cuts 1 .. L - 1 as views, read by
    units 1 .. L - 1 (synthetic.views_apart); holders[l]: the views unit l saves ({} where it saves none)."""
    rng = random.Random(seed)
    profile = synthetic_profile([1e-3] * L, [2e-3] * L, [0] * L, [rng.randint(1, 1 << 12) for _ in range(L)],
                                [rng.randint(1, 1 << 10) for _ in range(L - 1)], sizes=(2,))
    views_apart(profile, 1, L - 1, rng, parts=parts)
    holders = [(u.received_saved_parts.get(2) or {}).get("whole1", {}) for u in profile.units]
    return profile, holders


def _reference(profile, holders, a: int, e: int, redo=()) -> float:
    """What stage [a, e) holds per micro-batch: each unit's own bytes (s_l without the storage; in_l without its
    views where recomputed), and of the storage, inside a stage starting at unit 0 (its maker) all of it once
    where any unit holds a view, else each view held (saved, or kept by a recomputed unit) once."""
    costs = RangeCosts(profile, 2)
    views = profile.units[1].received_parts[2]["whole1"]
    own, held = 0.0, set()
    for l in range(a, e):
        unit = profile.units[l]
        saves = "whole1" in (unit.shared_saved_bytes.get(2) or {})
        if l in redo:
            own += costs.inputs[l] - (sum(views.values()) if l > 0 else 0)
            held |= set(views) if l > 0 else set()
        else:
            own += costs.s[l] - (sum(views.values()) if saves else 0)
            held |= set(holders[l])
    if a == 0:
        return own + (sum(views.values()) if held else 0)
    return own + sum(views[v] for v in held)


# (the profile's own terms alone count less than the reference on each of these chains)
@pytest.mark.parametrize("seed,parts", [(0, 3), (5, 2), (6, 2), (7, 3), (8, 3), (9, 3), (10, 2)])
def test_a_stage_holds_each_view_it_receives_apart_once_and_the_whole_storage_inside(seed, parts):
    # nothing recomputed: exactly the reference over every range; every set of recomputed units: never below it
    profile, holders = _chain(seed, parts)
    costs = RangeCosts(profile, 2)
    assert sorted(costs.views) == list(range(1, L))
    saved = costs.saved_matrix()
    for a in range(L):
        for e in range(a + 1, L + 1):
            assert costs.saved(a, e) == pytest.approx(_reference(profile, holders, a, e)), (a, e)
            assert saved[a, e] == pytest.approx(costs.saved(a, e))
            for n in range(1, e - a + 1):
                for redo in itertools.combinations(range(a, e), n):
                    assert costs.saved(a, e, redo) >= _reference(profile, holders, a, e, redo) - 1e-9, (a, e, redo)


def test_the_gap_and_the_first_unit_of_a_coupling_are_counted_as_received():
    # units 1 and 3 save the views p and q of one storage, unit 2 neither (a coupling's net_in and affine): a gap
    # pair inside a stage holding unit 0; a stage starting at 1 holds p and q (the gap no longer taken off), one
    # starting at 2 or 3 q alone (unit 3's whole storage no longer counted)
    rng = random.Random(0)
    profile = synthetic_profile([1e-3] * 4, [2e-3] * 4, [0] * 4, [1000] * 4, [100] * 3, sizes=(2,))
    views_apart(profile, 1, 3, rng)
    p, q = profile.units[1].received_parts[2]["whole1"]
    for l, mine in ((1, [p]), (2, []), (3, [q])):  # (as the profile measures them)
        unit = profile.units[l]
        views = unit.received_parts[2]["whole1"]
        whole = sum(views.values())
        unit.saved_bytes[2] = 2000 + (whole if mine else 0)
        unit.first_saved_bytes[2] = 2000 + sum(views[v] for v in mine)
        unit.shared_saved_bytes[2] = {"whole1": whole} if mine else {}
        unit.received_saved_parts[2] = {"whole1": {v: views[v] for v in mine}} if mine else {}
    views = profile.units[1].received_parts[2]["whole1"]
    costs = RangeCosts(profile, 2)
    assert costs.gaps == [(1, 3, float(sum(views.values())))]
    assert costs.saved(0, 4) == 2000 + 3 * 2000 + sum(views.values())
    assert costs.saved(1, 4) == 3 * 2000 + views[p] + views[q]
    assert costs.saved(2, 4) == costs.saved(3, 4) + 2000 == 2 * 2000 + views[q]
    # recomputing the middle unit keeps both views: the stage still holds each once (it held p alone: under)
    assert costs.saved(1, 4, [2]) == 2000 + costs.inputs[2] + 2000 + 0


def test_an_older_profile_without_the_views_never_counts_less_than_held():
    # received_parts and received_saved_parts absent (an older file): a stage starting where its first unit's
    # inputs arrive apart shares none of that unit's storages with later units (an over-count, never under)
    for seed, parts in itertools.product(range(12), (2, 3)):
        profile, holders = _chain(seed, parts)
        data = profile.to_json()
        for unit in data["units"]:
            unit.pop("received_parts", None)
            unit.pop("received_saved_parts", None)
        older = Profile.from_json(json.loads(json.dumps(data)))
        assert not any(u.received_parts for u in older.units)
        costs = RangeCosts(older, 2)
        for a in range(L):
            for e in range(a + 1, L + 1):
                assert costs.saved(a, e) >= _reference(profile, holders, a, e) - 1e-9, (seed, parts, a, e)


@pytest.mark.parametrize("schedule,recompute", [("1f1b", "none"), ("gpipe", "none"), ("zb-h1", "none"),
                                                ("1f1b", "all"), ("zb-h1", "all")])
def test_the_stage_tables_equal_evaluate_where_views_arrive_apart(schedule, recompute):
    # the branch and bound's and the program's stage tables (planner.cost.stage_memory) read each start's view
    profile, _ = _chain(2, 3)
    for ranks in (2, 3):
        opts = CostOptions(pipeline_ranks=ranks, global_batch=8, schedule=schedule, bandwidth=1e9,
                           recompute=recompute)
        matrices = memory_matrices(profile, 2, opts)
        for cuts in itertools.combinations(range(1, L), ranks - 1):
            edges = (0, *cuts, L)
            held = evaluate(profile, list(cuts), 2, opts, list(range(L)) if recompute == "all" else []).device_memory
            assert [float(matrices(g)[edges[g], edges[g + 1]]) for g in range(ranks)] == \
                pytest.approx(held, rel=1e-12), cuts


def test_the_chain_tables_take_each_start_as_received():
    # saved_correction: what the prefix form misses, the gaps and each start's own row
    profile, _ = _chain(3, 3)
    costs = RangeCosts(profile, 2)
    for redo_all in (False, True):
        prefix, start = costs.saved_prefix(redo_all), costs.saved_at_start(redo_all)
        correction = costs.saved_correction(redo_all)
        for a in range(L):
            for e in range(a + 1, L + 1):
                want = costs.saved(a, e, list(range(L)) if redo_all else [])
                assert prefix[e] - prefix[a] + start[a] + correction[a, e] == pytest.approx(want), (a, e)
        assert np.all(np.tril(correction) == 0)


@pytest.mark.parametrize("seed", range(8))
def test_each_start_sees_the_terms_of_every_unit_as_it_receives_them(seed):
    # a view's terms are made over the units from its start to the last holder of a storage named apart: the same
    # as over every unit (planner.cost.received.seen_from), at every unit and cut from its start on
    from planner.cost.received import apart_starts, seen_from
    from planner.cost.shared_storage import storage_terms
    from tests.support.synthetic import random_chain

    rng = random.Random(seed)
    profile = random_chain(rng, 8, sizes=(2,), apart=True)
    views_apart(profile, 1, 3, rng)
    views_apart(profile, 4, 6, rng, parts=3)
    costs = RangeCosts(profile, 2)
    for a, apart in apart_starts(profile, 2).items():
        units, view = seen_from(profile, 2, a, apart), costs.at(a)
        s = np.array([u.saved_bytes[2] for u in units], dtype=float)
        full = storage_terms(units, 2, s, costs.inputs, costs.inputs - costs.weight_inputs)
        assert np.array_equal(view.s, s)
        for name, value in full.items():
            if name in ("gaps", "held_gaps"):
                assert sorted(p for p in getattr(view, name) if p[0] >= a) == sorted(p for p in value if p[0] >= a)
            else:
                assert np.allclose(getattr(view, name)[a + 1:], value[a + 1:]), (a, name)
