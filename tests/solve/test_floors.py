"""The stage floors (planner/solve/floors.py) on random chains, every schedule: each floor holds for
every split through its range, the min-max bound is never above the best split (found by trying
every split), the floors' split is a split, and the vectorised completions equal the single-form
dynamic program."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.cost.model import candidate_micro_batch_sizes, compute_profile, evaluate
from planner.cost.options import CostOptions
from planner.pipeline.schedule import SCHEDULES
from planner.solve.forms import Forms, StageTerms
from planner.solve.exact import structural_forms
from planner.solve.floors import form_completions
from tests.support.synthetic import drawn_chain, synthetic_profile


@st.composite
def chains(draw):
    L = draw(st.integers(4, 9))
    profile = drawn_chain(draw, L)
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    v = 2 if schedule in ("interleaved", "bfs", "zb-v") else 1
    p = draw(st.integers(2, min(4 if v == 1 else 3, L // v)))
    opts = CostOptions(pipeline_ranks=p, global_batch=draw(st.sampled_from([4, 8])), schedule=schedule,
                       virtual_stages=v, data_parallel=draw(st.sampled_from([1, 1, 2])),
                       bandwidth=draw(st.sampled_from([2e5, 1e8])), latency=draw(st.sampled_from([0.0, 5e-5])),
                       message_s=draw(st.sampled_from([0.0, 2e-5])), optimizer="adamw",
                       recompute=draw(st.sampled_from(["none", "all"])),
                       memory_cap=draw(st.sampled_from([None, None, 12000.0])))
    return profile, opts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.booleans())
def test_the_floors_hold_for_every_split(problem, learned):
    profile, opts = problem
    assume(opts.global_batch % opts.data_parallel == 0)
    profile = compute_profile(profile, opts)
    sizes = candidate_micro_batch_sizes(profile, opts.global_batch, opts)
    assume(sizes)
    b = sizes[0]
    L, S = profile.num_units, opts.num_stages
    redo = list(range(L)) if opts.recompute == "all" else []
    steps = {}
    for cuts in itertools.combinations(range(1, L), S - 1):
        cost = evaluate(profile, list(cuts), b, opts, redo)
        if cost.feasible:
            steps[cuts] = (cost.iteration_s - opts.step_overhead_s, cost.critical_path)
    known = Forms(StageTerms(profile, b, opts), opts.message_s)
    for form in structural_forms(profile, b, opts):
        known.add(form)
    if learned:  # some splits' own paths, as the search learns them
        for cuts in list(steps)[::3]:
            known.add(steps[cuts][1])
    best = min((step for step, _ in steps.values()), default=math.inf)
    target = best * 1.05 if steps else math.inf  # a target above the best: its splits must stay allowed
    known.refresh(target)
    if not len(known):
        return
    for cuts, (step, _) in steps.items():
        ends = cuts + (L,)
        starts = (0,) + cuts
        if step < target:
            for g, (a, e) in enumerate(zip(starts, ends)):
                assert known.terms.allowed[g][a, e], "a stage of a split faster than the target was dropped"
                assert known.floors[g][a, e] <= step * (1 + 1e-9) + 1e-15
    if steps:
        assert known.least[0, 0] <= best * (1 + 1e-9) + 1e-15
    if known.least_split is not None:
        split = known.least_split
        assert len(split) == S and split[-1] == L and all(x < y for x, y in zip((0,) + split, split))
    # the forms completed together are each completed alone
    for k in range(len(known)):
        D = form_completions(known.coefficients[:, k:k + 1, :], known.terms.band)[0]
        finite = np.isfinite(D)
        assert np.array_equal(finite, np.isfinite(known.completion[k]))
        assert np.allclose(D[finite], known.completion[k][finite], rtol=1e-9, atol=1e-15)


def test_the_floors_couple_the_stages():
    """Six equal units in two 1F1B stages: each form alone may shrink its steady stage to one unit,
    the floors may not -- the min-max bound is the bottleneck's (three units), far above the single
    forms' bound, and never above the best split."""
    profile = synthetic_profile(forward=[1e-3] * 6, backward=[2e-3] * 6, params=[1000] * 6, saved=[100] * 6,
                                cut_act=[0] * 5)
    opts = CostOptions(pipeline_ranks=2, global_batch=16, bandwidth=1e12, latency=0.0)
    profile = compute_profile(profile, opts)
    b = 1
    known = Forms(StageTerms(profile, b, opts), opts.message_s)
    for form in structural_forms(profile, b, opts):
        known.add(form)
    for cut in range(1, 6):
        known.add(evaluate(profile, [cut], b, opts).critical_path)
    known.refresh(math.inf)
    single = float((known.constant + known.completion[:, 0, 0]).max())
    best = min(evaluate(profile, [c], b, opts).iteration_s for c in range(1, 6)) - opts.step_overhead_s
    assert known.least[0, 0] <= best * (1 + 1e-9)
    assert known.least[0, 0] > 1.5 * single
    assert known.least_split == (3, 6)


def test_the_table_estimate_covers_the_tables():
    """branch.table_bytes (which decides whether the search runs or the integer program) is at least
    what the search's tables take: like devices, four devices of four speeds, and a cap that every stage's
    long ranges need recomputation under."""
    import random

    from planner.cost.cluster import Cluster, DeviceGroup, Link
    from planner.cost.stage_memory import StageMemory
    from planner.solve.forms import table_bytes
    from tests.support.synthetic import random_chain

    profile = random_chain(random.Random(3), 40, sizes=(2,))
    cluster = Cluster(groups=tuple(DeviceGroup(f"g{i}", 1, speed=1.0 + i / 4) for i in range(4)),
                      links=(Link(1e9, 1e-5),) * 3)
    # (and under --recompute auto with a cap most ranges need recomputation under: a table of its own per stage,
    # planner.solve.recompute_bound)
    capped = CostOptions(pipeline_ranks=4, global_batch=16, recompute="auto", memory_cap=float(
        StageMemory(profile, 2, CostOptions(pipeline_ranks=4, global_batch=16), False).matrix(0)[0, 10]))
    for opts in (CostOptions(pipeline_ranks=4, global_batch=16), CostOptions(pipeline_ranks=4, global_batch=16,
                                                                               cluster=cluster), capped):
        known = Forms(StageTerms(profile, 2, opts), opts.message_s)
        for form in structural_forms(profile, 2, opts):
            known.add(form)
        known.refresh(math.inf)
        terms = known.terms
        tables = {id(row): row.nbytes for row in terms.rows}
        taken = sum(tables.values()) + sum(f.nbytes for f in known.floors) + \
            sum(a.nbytes for a in terms.allowed) + sum(f.nbytes for f in terms.fits)
        assert taken <= table_bytes(profile.num_units, opts)
        assert len(tables) == (2 if opts.cluster is None and opts.memory_cap is None else 4)


def test_a_refresh_past_its_deadline_keeps_the_tables_it_had():
    """A refresh that runs out of time (the search's time limit) keeps no half-done table: the
    completions and floors from before stand (they bound every split: the ranges allowed only
    shrink), and the search's bound still holds. (Before, such a refresh left completions of 0 and no
    floors, and a search stopped soon after reported its prefixes alone as its bound.)"""
    import random
    import time

    from planner.solve.branch import branch_and_bound
    from planner.solve.floors import OutOfTime, form_completions
    from tests.support.synthetic import random_chain

    profile = random_chain(random.Random(5), 12, sizes=(2,))
    opts = CostOptions(pipeline_ranks=3, global_batch=16)
    known = Forms(StageTerms(profile, 2, opts), opts.message_s)
    for form in structural_forms(profile, 2, opts):
        known.add(form)
    with pytest.raises(OutOfTime):
        form_completions(known.coefficients, known.terms.band, deadline=time.perf_counter() - 1)
    completion = known.completion.copy()
    known.deadline = time.perf_counter() - 1
    known.refresh(math.inf)
    assert (known.completion == completion).all() and known.floors is None and known.least_split is None
    known.deadline = None
    known.refresh(math.inf)  # now with floors, then past the deadline again: refresh and extend keep them
    assert known.floors is not None
    kept = (known.completion.copy(), [f.copy() for f in known.floors], known.least.copy(), known.least_split)
    known.deadline = time.perf_counter() - 1
    known.refresh(known.least[0, 0] * 1.01)
    assert (known.completion == kept[0]).all() and known.least_split == kept[3] and (known.least == kept[2]).all()
    assert all((f == g).all() for f, g in zip(known.floors, kept[1]))
    # a form the floors do not count yet
    assert any(known.add(evaluate(profile, list(cuts), 2, opts).critical_path)
               for cuts in itertools.combinations(range(1, 12), 2))
    known.extend(known.least[0, 0] * 1.01)
    assert all((f == g).all() for f, g in zip(known.floors, kept[1])) and (known.least == kept[2]).all()
    assert known.floored == len(known) - 1
    best = min(evaluate(profile, list(cuts), 2, opts).iteration_s for cuts in itertools.combinations(range(1, 12), 2))
    found = branch_and_bound(profile, 2, opts, None, structural_forms(profile, 2, opts), time_limit=1e-9)
    assert found.bound_s <= best * (1 + 1e-9)
