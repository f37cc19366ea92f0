"""The per-stage conditions (planner.solve.reach.stage_conditions): every stage of a split faster than
the bound passes them, and testing only the ranges `within` gives the full test's answer there."""
import itertools
import random

import numpy as np
import pytest

from planner.cost.model import compute_profile, evaluate
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.solve.reach import stage_conditions
from tests.support.synthetic import random_chain


def test_conditions_keep_every_faster_split_and_within_only_narrows():
    for seed in range(6):
        rng = random.Random(seed)
        L, S = rng.randint(5, 8), rng.choice([2, 3])
        opts = CostOptions(pipeline_ranks=S, global_batch=8, schedule=rng.choice(["1f1b", "gpipe"]))
        profile = compute_profile(random_chain(rng, L, sizes=(2,)), opts)
        splits = [list(c) for c in itertools.combinations(range(1, L), S - 1)]
        steps = {tuple(c): evaluate(profile, c, 2, opts) for c in splits}
        forms = [cost.critical_path.count() for cost in list(steps.values())[::3]]
        bound = float(np.median([cost.iteration_s for cost in steps.values()]))
        costs = range_costs(profile, 2, opts.optimizer)
        ok = stage_conditions(costs, S, [1.0] * S, forms, bound)
        for cuts, cost in steps.items():
            if cost.iteration_s < bound:
                ends = list(cuts) + [L]
                assert all(ok[g][a, e] for g, (a, e) in enumerate(zip([0] + list(cuts), ends)))
        assert sum(int(o.sum()) for o in ok) < S * L * (L + 1) // 2  # the bound excludes some ranges
        within = [rng_mask(rng, L) for _ in range(S)]
        narrowed = stage_conditions(costs, S, [1.0] * S, forms, bound, within=within)
        for g in range(S):
            assert np.array_equal(narrowed[g], ok[g] & within[g])


def rng_mask(rng, L):
    return np.array([[rng.random() < 0.6 for _ in range(L + 1)] for _ in range(L + 1)])


def test_a_stage_whose_first_unit_saves_less_when_received_is_not_dropped_by_the_memory_precheck():
    """first_a < -d_a (an input that is a slice of a larger storage inside a stage, its own storage
    when received): the fixings' least bytes per stage counted the inside-a-stage bytes and dropped a
    stage that fits (a review of the change)."""
    import math

    from planner.solve.exact import _fixings
    from tests.plan.test_plan import small_profile

    profile = small_profile()
    for b in (1, 2, 4):
        profile.units[2].first_saved_bytes[b] = profile.units[2].saved_bytes[b] // 4
    base = CostOptions(pipeline_ranks=3, global_batch=8, latency=1e-5)
    cap = evaluate(profile, [1, 2], 4, base).device_memory[2]  # the last stage [2, 4) exactly
    opts = CostOptions(pipeline_ranks=3, global_batch=8, latency=1e-5, memory_cap=cap)
    assert evaluate(profile, [1, 2], 4, opts).feasible
    lowest, highest = _fixings(profile, 4, opts, set(), math.inf)
    assert highest[2] == 2  # unit 2 may be in stage 2: only the split [1, 2] puts it there


def test_conditions_stop_at_the_deadline():
    # O(L^2) per stage and form family (seconds at thousands of units): a search's time limit stops them
    import time

    import pytest

    from planner.solve.floors import OutOfTime

    opts = CostOptions(pipeline_ranks=2, global_batch=8)
    profile = compute_profile(random_chain(random.Random(0), 6, sizes=(2,)), opts)
    form = evaluate(profile, [3], 2, opts).critical_path.count()
    costs = range_costs(profile, 2, opts.optimizer)
    with pytest.raises(OutOfTime):
        stage_conditions(costs, 2, [1.0] * 2, [form], 1.0, deadline=time.perf_counter() - 1)
    timed = stage_conditions(costs, 2, [1.0] * 2, [form], 1.0, deadline=time.perf_counter() + 60)
    untimed = stage_conditions(costs, 2, [1.0] * 2, [form], 1.0)
    assert all(np.array_equal(x, y) for x, y in zip(timed, untimed)) and len(timed) == 2


def test_the_memory_precheck_counts_no_stage_above_what_it_saves():
    """The fixings' least bytes per range (planner.solve.exact.least_saved) are at most what the range saves under
    every recomputation set the mode allows: the storages two units apart save, held once (a gap), and the views a
    stage receives apart (planner.cost.received) taken as that stage counts them; it counted neither, and would
    drop a stage that fits."""
    from planner.cost.ranges import RangeCosts
    from planner.solve.exact import least_saved
    from tests.support.synthetic import random_chain, views_apart

    for seed in range(6):
        rng = random.Random(seed)
        profile = random_chain(rng, 6, sizes=(2,), apart=True)
        for l, j in ((0, 2), (2, 5)):  # a storage units l and j save, none between them
            for unit in (profile.units[l], profile.units[j]):
                unit.saved_bytes[2] += 4096
                unit.shared_saved_bytes.setdefault(2, {})[f"apart{l}"] = 4096
        views_apart(profile, 1, 4, rng)
        costs = RangeCosts(profile, 2)
        assert costs.gaps and costs.views
        for mode in ("none", "auto", "all"):
            least = least_saved(costs, mode)
            for a in range(6):
                for e in range(a + 1, 7):
                    sets = {"none": [()], "all": [tuple(range(a, e))],
                            "auto": [r for n in range(e - a + 1) for r in itertools.combinations(range(a, e), n)]}
                    for redo in sets[mode]:
                        assert least[a, e] <= costs.saved(a, e, redo) + 1e-6, (seed, mode, a, e, redo)
                    if mode == "none":  # and no lower: what the range saves, less only its start's d_a + first_a > 0
                        start = costs.at(a)
                        slack = max(0.0, float(start.dup[a] + start.first[a]))
                        assert least[a, e] == pytest.approx(costs.saved(a, e) - slack), (seed, a, e)
