"""The branch and bound over splits (planner/solve/branch.py) against every split, one micro-batch
size at a time: the same optimum (every schedule, v = 1 and 2, memory caps, recomputation all, d = 2,
reserves), and a proven bound that is never above it, also when the search stops at its time limit."""
import itertools
import math
import time
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.cost.model import candidate_micro_batch_sizes, compute_profile, evaluate
from planner.cost.options import CostOptions
from planner.solve import branch, floors
from planner.solve.branch import applies, branch_and_bound
from planner.solve.exact import structural_forms
from planner.solve.forms import Forms, StageTerms
from tests.support.solvers import stopped_searches, ticking_clock
from tests.support.synthetic import drawn_chain, synthetic_profile


@st.composite
def chains(draw):
    L = draw(st.integers(3, 9))
    profile = drawn_chain(draw, L)
    schedule, v = draw(st.sampled_from([("1f1b", 1), ("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2),
                                        ("bfs", 2), ("zb-v", 2)]))
    p = draw(st.integers(1, max(1, min(5 if v == 1 else 3, L // v))))
    d = draw(st.sampled_from([1, 1, 2]))
    opts = CostOptions(pipeline_ranks=p, global_batch=d * 4 * p * draw(st.sampled_from([1, 2])),
                       schedule=schedule, virtual_stages=v, data_parallel=d,
                       bandwidth=draw(st.sampled_from([2e5, 1e6, 1e8])), latency=draw(st.sampled_from([0.0, 5e-5])),
                       message_s=draw(st.sampled_from([0.0, 2e-5])), optimizer=draw(st.sampled_from(["sgd", "adamw"])),
                       memory_cap=draw(st.sampled_from([None, None, 6000.0, 12000.0, 30000.0])),
                       recompute=draw(st.sampled_from(["none", "none", "all"])),
                       step_overhead_s=draw(st.sampled_from([0.0, 1e-3])),
                       reserve_bytes=draw(st.sampled_from([None, 0.0, 1500.0])))
    return profile, opts


def _every_split(profile, b, opts):
    L, S = profile.num_units, opts.num_stages
    redo = list(range(L)) if opts.recompute == "all" else []
    best = math.inf
    for cuts in itertools.combinations(range(1, L), S - 1):
        cost = evaluate(profile, list(cuts), b, opts, redo)
        if cost.feasible:
            best = min(best, cost.iteration_s)
    return best


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.booleans(), st.booleans())
def test_branch_and_bound_finds_the_best_split(problem, seeded, dual_first):
    """dual_first: the dual ascent's combination joins the bound from the first node (planner.solve.dual)."""
    profile, opts = problem
    profile = compute_profile(profile, opts)
    assert applies(profile, opts)
    for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
        forms = structural_forms(profile, b, opts) if seeded else set()
        with mock.patch.object(branch, "DUAL_AFTER_NODES", 0 if dual_first else branch.DUAL_AFTER_NODES):
            found = branch_and_bound(profile, b, opts, None, forms, time_limit=None)
        best = _every_split(profile, b, opts)
        assert found.optimal
        if math.isinf(best):
            assert found.best is None
            continue
        assert found.best is not None
        assert math.isclose(found.best.iteration_s, best, rel_tol=1e-9)
        again = evaluate(profile, found.best.boundaries, b, opts, found.best.recompute)
        assert again.feasible and math.isclose(again.iteration_s, best, rel_tol=1e-9)
        assert found.bound_s <= best * (1 + 1e-9)



@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.sampled_from([0.0, 2.0, 5.0, 20.0, 80.0]))
def test_a_search_stopped_early_still_proves_a_valid_bound(problem, ticks):
    """At its time limit the search returns the least bound of the nodes left open, each re-bounded
    with every form learned by then (_open_bound): never above the best split, and its incumbent a
    real one. The clock is a counter (each read one tick), so the search stops after a few nodes;
    the tables' clock (planner.solve.floors) stands still: on the real one their deadline, a few
    ticks, has long passed and every search would stop before its first node."""

    for found, _ in stopped_searches(*problem, ticks, _every_split):
        if not found.optimal:
            assert found.bound_s <= (found.best.iteration_s if found.best else math.inf)

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.sampled_from([2.0, 5.0, 20.0]))
def test_the_open_nodes_least_bound_first_walk_stops_exactly(problem, ticks):
    """_open_bound walks the open nodes least stored bound first and stops at the first whose own
    bound reaches the least re-bounded value: what every node re-bounded gives (no budget here)."""

    profile, opts = problem
    profile = compute_profile(profile, opts)
    calls = []

    def walked(known, stack, target, refresh, budget_s=math.inf):
        got = _open_bound(known, stack, target, refresh)
        every = slice(0, len(known))
        each = [max(bound, float((branch.form_prefix(known, every, cuts) + known.completion[:, g, a]).max(initial=-math.inf)),
                    float(known.least[g, a])) for bound, g, a, cuts, _ in stack]
        assert got == min(each, default=math.inf)
        calls.append(len(stack))
        return got

    _open_bound = branch._open_bound
    for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
        with mock.patch.object(branch, "_open_bound", walked), ticking_clock():
            branch_and_bound(profile, b, opts, None, set(), time_limit=ticks)
    assume(calls)  # some search stopped at its limit with nodes open


def test_it_does_not_apply_where_a_term_spans_stages():
    profile = synthetic_profile(forward=[1e-3] * 4, backward=[2e-3] * 4, params=[10] * 4, saved=[10] * 4,
                                cut_act=[10] * 3, sizes=(1,))
    assert applies(profile, CostOptions(pipeline_ranks=2, global_batch=4))
    assert applies(profile, CostOptions(pipeline_ranks=2, global_batch=4, schedule="interleaved", virtual_stages=2))
    assert not applies(profile, CostOptions(pipeline_ranks=3, global_batch=4, replicas=(1, 2)))
    assert not applies(profile, CostOptions(pipeline_ranks=2, global_batch=4, recompute="auto"))
    profile.extra["shared_parameters"] = [{"name": "tied", "units": ["u0", "u3"], "bytes": 8}]
    assert not applies(profile, CostOptions(pipeline_ranks=2, global_batch=4))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_a_cap_the_best_split_meets_exactly_keeps_it(problem):
    """Caps that bind: the unconstrained best split's own peak becomes every device's cap, so it fits
    exactly (caps are inclusive) and stays the optimum; the reserve counted once."""
    profile, opts = problem
    profile = compute_profile(profile, opts.with_(memory_cap=None))
    free = opts.with_(memory_cap=None)
    b = candidate_micro_batch_sizes(profile, opts.global_batch, opts)[0]
    L, S = profile.num_units, opts.num_stages
    redo = list(range(L)) if opts.recompute == "all" else []
    costs = {cuts: evaluate(profile, list(cuts), b, free, redo) for cuts in itertools.combinations(range(1, L), S - 1)}
    cuts, best = min(costs.items(), key=lambda item: item[1].iteration_s)
    assume(max(best.device_memory) > 0)  # a cap must be positive
    capped = opts.with_(memory_cap=max(best.device_memory))
    expected = min(c.iteration_s for k, c in costs.items() if max(c.device_memory) <= capped.memory_cap)
    found = branch_and_bound(profile, b, capped, None, set(), time_limit=None)
    assert found.best is not None and math.isclose(found.best.iteration_s, expected, rel_tol=1e-9)


def frozen_front_on_two_sites(L=6, frozen=4, gradient_from=None):
    """(profile, options): the first `frozen` of L units frozen, p = 2 x d = 2 placed so that each
    rank's exchange crosses a site link of 0.02 s latency (40 ms of rings, paid only by a rank that
    exchanges anything: planner.cost.exchange.reduce_time). Gradients cross the cuts from cut
    `gradient_from` + 1 on (default: none crosses the frozen front)."""
    import dataclasses

    from planner.cost.placement import Placement
    from planner.cost.topology_file import topology_from_json

    start = frozen if gradient_from is None else gradient_from
    topology = topology_from_json({"levels": [{"name": "site", "count": 2, "bandwidth": 1e8, "latency": 0.02},
                                              {"name": "device", "count": 2, "bandwidth": 1e9}]})
    profile = synthetic_profile(forward=[1e-3] * L, backward=[2e-3] * L, params=[1 << 16] * L, saved=[100] * L,
                                cut_act=[1 << 10] * (L - 1), cut_grad=[0] * start + [1 << 10] * (L - 1 - start),
                                sizes=(1,))
    profile = dataclasses.replace(profile, units=[dataclasses.replace(u, trainable_bytes=0 if k < frozen else
                                                                      u.param_bytes)
                                                  for k, u in enumerate(profile.units)])
    opts = CostOptions(pipeline_ranks=2, global_batch=8, data_parallel=2,
                       placement=Placement(topology, ((0, 1), (2, 3))))
    return profile, opts


def test_a_rank_of_frozen_units_only_is_found_and_bounded_exactly():
    """A rank with nothing to exchange pays no rings' latency: the stage's reduce row carries it only
    where the stage exchanges bytes (1/v of it for v > 1, a bound), so the best split -- one rank
    holding only frozen units -- is found and the proven bound stays below it."""
    from planner.cost.model import evaluate as cost_of

    base_profile, base = frozen_front_on_two_sites()
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("zb-v", 2)):
        opts = base.with_(schedule=schedule, virtual_stages=v)
        profile = compute_profile(base_profile, opts)
        best = _every_split(profile, 1, opts)
        for forms in (set(), structural_forms(profile, 1, opts)):
            found = branch_and_bound(profile, 1, opts, None, forms, time_limit=None)
            assert found.optimal and math.isclose(found.best.iteration_s, best, rel_tol=1e-9), schedule
            assert found.bound_s <= best * (1 + 1e-9)
        # every form learned, as the search values it, is at most every split's step (a valid bound)
        known = Forms(StageTerms(profile, 1, opts), opts.message_s)
        for form in found.forms:
            known.add(form)
        for cuts in itertools.combinations(range(1, profile.num_units), opts.num_stages - 1):
            values = branch.form_prefix(known, slice(0, len(known)), list(cuts) + [profile.num_units])
            assert values.max() <= cost_of(profile, list(cuts), 1, opts).iteration_s * (1 + 1e-12), (schedule, cuts)
        if schedule != "interleaved":  # there, one crossing less beats it by 0.6 ms
            reduces = cost_of(profile, found.best.boundaries, 1, opts).durations
            assert min(reduces[("reduce", i)] for i in range(2)) == 0.0, schedule  # the optimum: a frozen-only rank


def test_tables_the_time_limit_cannot_pay_for_end_the_search_with_its_incumbent():
    """At thousands of units the tables take seconds: a search whose limit passes while they are built
    stops there (no node) with the incumbent and a bound that holds (durations are >= 0), and the
    tables stop at the deadline rather than after it."""
    import time

    from planner.solve.floors import OutOfTime
    from planner.solve.solution import Candidate

    profile = synthetic_profile([1e-3] * 6, [2e-3] * 6, [10] * 6, [10] * 6, [10] * 5, sizes=(1,))
    opts = CostOptions(pipeline_ranks=3, global_batch=4, step_overhead_s=1e-4)
    with pytest.raises(OutOfTime):
        StageTerms(profile, 1, opts, deadline=time.perf_counter() - 1)
    incumbent = Candidate(evaluate(profile, [2, 4], 1, opts).iteration_s, [2, 4], [])
    with mock.patch.object(branch, "time", SimpleNamespace(perf_counter=lambda: 0.0)), \
            mock.patch.object(floors, "time", SimpleNamespace(perf_counter=lambda: 5.0)):
        outcome = branch_and_bound(profile, 1, opts, incumbent, set(), time_limit=2.0)
    assert outcome.best is incumbent and not outcome.optimal and outcome.nodes == 0
    assert outcome.bound_s == opts.step_overhead_s


def _forms_of(profile, b, opts, rng, splits=6):
    """The search's tables with the structural forms and the longest paths of a few random splits."""
    terms = StageTerms(profile, b, opts)
    known = Forms(terms, opts.message_s)
    forms = set(structural_forms(profile, b, opts))
    L, S = profile.num_units, opts.num_stages
    redo = list(range(L)) if opts.recompute == "all" else []
    for _ in range(splits):
        cuts = sorted(rng.sample(range(1, L), S - 1))
        forms.add(evaluate(profile, cuts, b, opts, redo).critical_path)
    for form in forms:
        known.add(form, complete=False)
    return known


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.integers(0, 2 ** 16), st.lists(st.sampled_from([0.5, 0.9, 0.97, 0.99, 1.0, 1.001, 1.02, 1.1,
                                                                   1.5, 3.0]), min_size=1, max_size=4))
def test_a_probe_below_the_target_never_passes_the_best_split(problem, seed, ratios):
    """Forms.probe(T) = min(T, M(T)), the floors for a target T below the search's, holds for every split
    whatever T (a split faster than T has every stage allowed for T); the search for the T where M meets T
    (branch._probed_bound) too; and a probe puts the allowed stages and tables back."""
    import random

    import numpy as np

    profile, opts = problem
    profile = compute_profile(profile, opts)
    for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
        best = _every_split(profile, b, opts)
        assume(math.isfinite(best) and best > 0)
        known = _forms_of(profile, b, opts, random.Random(seed))
        start = best * 1.2
        known.refresh(start)
        allowed = [ok.copy() for ok in known.terms.allowed]
        least = known.least.copy()
        for ratio in ratios:
            probed = known.probe(best * ratio)
            assert probed is not None and probed <= best * (1 + 1e-9)
            assert all((ok == was).all() for ok, was in zip(known.terms.allowed, allowed))
            assert np.array_equal(known.least, least)
        found = branch._probed_bound(known, -math.inf, start, math.inf)
        assert found <= best * (1 + 1e-9)
        assert found >= 0.0
        # a probe past its deadline (OutOfTime inside the refresh) leaves the very tables it found
        terms = known.terms
        before = (terms.allowed, terms.band, terms.window, known.completion, known.floors, known.least)
        known.deadline = time.perf_counter() - 1.0
        assert known.probe(best * 0.9) is None
        after = (terms.allowed, terms.band, terms.window, known.completion, known.floors, known.least)
        assert all(x is y for x, y in zip(before, after))
        known.deadline = None


def test_the_probes_seek_where_the_floors_meet_the_target():
    """_probed_bound against a made-up M(T) that rises as T falls (as the floors do): each probe's
    min(T, M(T)) kept, and the search ends near the T where M(T) = T, never above it; at the deadline or
    without forms it keeps the bound it was given."""

    class Made:
        refresh_s = 0.0

        def __init__(self, M, forms=1):
            self.M, self.forms, self.targets = M, forms, []

        def __len__(self):
            return self.forms

        def probe(self, target):
            self.targets.append(target)
            return min(target, self.M(target))

    for M in (lambda T: 10.0 - 0.5 * T, lambda T: 7.0 if T < 6.5 else 6.0, lambda T: math.inf if T < 5.0 else 4.0):
        crossing = max(T / 1000 for T in range(1, 10_000) if M(T / 1000) >= T / 1000)
        made = Made(M)
        found = branch._probed_bound(made, 1.0, 9.0, math.inf)
        assert found <= crossing + 1e-3  # (the grid's step)
        assert found >= crossing - (9.0 - 1.0) * (2 / 3) ** branch.PROBES - 1e-3
        assert len(made.targets) <= branch.PROBES
    assert branch._probed_bound(Made(lambda T: 9.0, forms=0), 1.0, 9.0, math.inf) == 1.0
    assert branch._probed_bound(Made(lambda T: 9.0), 1.0, 9.0, -1.0) == 1.0  # past its deadline
