"""Each rank's span (planner.solve.rank_span): the inequality every rank satisfies split by split, the
Lagrangian bound against every split, and the one-stage-per-device span term of the scenario bound."""
import itertools
import random

import numpy as np
import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.solve.rank_span import RankSpans, rank_span_bound
from planner.solve.scenario_bound import scenario_lower_bound
from tests.support.synthetic import random_chain, synthetic_profile

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3), ("bfs", 2), ("zb-v", 2)]


def _case(seed, sizes=(2,)):
    rng = random.Random(seed)
    schedule, v = SCHEDULES[seed % len(SCHEDULES)]
    p = rng.randint(2, 3)
    L = rng.randint(p * v, p * v + 3)
    profile = random_chain(rng, L, sizes=sizes, frozen=rng.random() < 0.3, stage_overhead=rng.random() < 0.3)
    opts = CostOptions(pipeline_ranks=p, global_batch=2 * p * rng.choice([1, 2, 3]), schedule=schedule,
                       virtual_stages=v, bandwidth=rng.choice([5e1, 5e3, 1e8]), message_s=rng.choice([0.0, 1e-4]),
                       latency=rng.choice([0.0, 1e-4]), recompute=rng.choice(["none", "all"]), optimizer="sgd")
    return profile, opts, L


@pytest.mark.parametrize("seed", range(35))
def test_every_rank_spans_at_least_its_fill_work_and_drain(seed):
    """The inequality the bound rests on: at every split the step is at least each rank's T_r."""
    profile, opts, L = _case(seed)
    m, redo = opts.global_batch // 2, list(range(L)) if opts.recompute == "all" else []
    spans = RankSpans(range_costs(profile, 2, "sgd"), opts, m, L)
    for cuts in itertools.islice(itertools.combinations(range(1, L), opts.num_stages - 1), 15):
        step = evaluate(profile, list(cuts), 2, opts, redo).iteration_s - opts.step_overhead_s
        assert spans.spans(list(cuts)).max() <= step * (1 + 1e-12), (cuts, spans.spans(list(cuts)), step)


@pytest.mark.parametrize("seed", range(35))
def test_the_weighted_least_is_the_least_over_every_split(seed):
    """RankSpans.least: the dynamic program over the boundaries against every split, for random weights."""
    profile, opts, L = _case(seed)
    spans = RankSpans(range_costs(profile, 2, "sgd"), opts, opts.global_batch // 2, L)
    weights = np.random.default_rng(seed).dirichlet(np.ones(spans.p * spans.per_rank))  # one per rank and anchor
    value, boundaries = spans.least(weights)
    every = [float(weights @ spans.spans(list(c))) for c in itertools.combinations(range(1, L), opts.num_stages - 1)]
    assert value == pytest.approx(min(every), rel=1e-12, abs=1e-15)
    assert float(weights @ spans.spans(boundaries)) == pytest.approx(value, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("seed", range(35))
def test_the_bound_holds_for_every_split(seed):
    profile, opts, L = _case(seed, sizes=(1, 2))
    redo = list(range(L)) if opts.recompute == "all" else []
    for b in (1, 2):
        m = opts.global_batch // b
        best = min(evaluate(profile, list(c), b, opts, redo).iteration_s
                   for c in itertools.combinations(range(1, L), opts.num_stages - 1))
        assert rank_span_bound(range_costs(profile, b, "sgd"), opts, m, L) + opts.step_overhead_s <= \
            best * (1 + 1e-9)
        assert scenario_lower_bound(profile, b, opts) <= best * (1 + 1e-9)


MULTI = [("interleaved", 2), ("interleaved", 3), ("interleaved", 4), ("bfs", 2), ("bfs", 3), ("bfs", 4), ("zb-v", 2)]


@pytest.mark.parametrize("seed", range(70))
def test_every_anchor_s_row_holds_at_every_split(seed):
    """Each rank's rows from each anchor (the first forward and the first backward of each of its stages),
    against every split of random chains: every schedule with v >= 2 (v <= 4, p <= 4, one rank included),
    m from 1 to 4 p + 3 (interleaved: multiples of p), slow links, per-message cost, latency, recompute
    none / all, frozen units, stage call costs; and the bound against the best split."""
    rng = random.Random(1000 + seed)
    schedule, v = MULTI[seed % len(MULTI)]
    p = rng.randint(1, 4)
    L, m = rng.randint(p * v, p * v + 3), rng.randint(1, 4 * p + 3)
    if schedule == "interleaved":
        m = p * max(1, m // p)
    b = rng.choice([1, 2])
    profile = random_chain(rng, L, sizes=(1, 2), frozen=rng.random() < 0.4, stage_overhead=rng.random() < 0.4)
    opts = CostOptions(pipeline_ranks=p, global_batch=m * b, schedule=schedule, virtual_stages=v,
                       bandwidth=rng.choice([5e1, 2e3, 5e5, 1e8]), message_s=rng.choice([0.0, 1e-4, 1e-3]),
                       latency=rng.choice([0.0, 1e-4, 1e-3]), recompute=rng.choice(["none", "all"]), optimizer="sgd")
    redo = list(range(L)) if opts.recompute == "all" else []
    costs = range_costs(profile, b, "sgd")
    spans, best = RankSpans(costs, opts, m, L), np.inf
    for cuts in itertools.combinations(range(1, L), opts.num_stages - 1):
        step = evaluate(profile, list(cuts), b, opts, redo).iteration_s
        assert spans.spans(list(cuts)).max() <= step * (1 + 1e-9), (cuts, spans.spans(list(cuts)), step)
        best = min(best, step)
    assert rank_span_bound(costs, opts, m, L) <= best * (1 + 1e-9)


def test_a_rank_s_second_stage_waits_for_micro_batch_0():
    """Breadth-first on two devices, two stages each, one micro-batch, four equal units: rank 0's first
    backward, of stage 0, waits for micro-batch 0's forwards through every stage and its backward down to
    stage 1. The ranks' whole spans saw 9 of the step's 12 ms (rank 1: stage 0's forward, its own computes,
    stage 0's backward); the row from that backward on sees the whole chain: the step."""
    profile = synthetic_profile([1e-3] * 4, [2e-3] * 4, [0] * 4, [0] * 4, [0] * 3, sizes=(1,))
    opts = CostOptions(pipeline_ranks=2, global_batch=1, schedule="bfs", virtual_stages=2, optimizer="sgd")
    best = min(evaluate(profile, list(c), 1, opts).iteration_s for c in itertools.combinations(range(1, 4), 3))
    assert rank_span_bound(range_costs(profile, 1, "sgd"), opts, 1, 4) == pytest.approx(best, rel=1e-9)


def test_the_spans_see_each_rank_s_two_stages():
    """Eight equal units, two devices, two stages each: each rank runs half of the work, and the last one
    starts only once micro-batch 0 crossed the first quarter and ends only after its gradient crossed it
    again. The spans' bound is 88 % of the best split's step (the busiest rank's share alone: 86 %)."""
    profile = synthetic_profile([1e-3] * 8, [2e-3] * 8, [0] * 8, [0] * 8, [0] * 7)
    opts = CostOptions(pipeline_ranks=2, global_batch=4, schedule="interleaved", virtual_stages=2, optimizer="sgd")
    best = min(evaluate(profile, list(c), 1, opts).iteration_s for c in itertools.combinations(range(1, 8), 3))
    spans = rank_span_bound(range_costs(profile, 1, "sgd"), opts, 4, 8)
    assert 0.88 * best <= spans <= best * (1 + 1e-12)
    assert scenario_lower_bound(profile, 1, opts) >= spans


def test_one_stage_per_device_counts_the_sends_a_rank_waits_for():
    """1F1B on three devices, activations 40x the gradients over a slow link: a rank's steady-state batch
    sends an activation and receives a gradient at one cut, and waits for the longer; counting the
    receive alone, the bound saw a fortieth of that wait (58 % of the best split's step; now 98 %)."""
    profile = synthetic_profile([1e-4] * 6, [1e-4] * 6, [0] * 6, [0] * 6, [40_000] * 5, [1_000] * 5)
    opts = CostOptions(pipeline_ranks=3, global_batch=8, schedule="1f1b", bandwidth=1e7, optimizer="sgd")
    best = min(evaluate(profile, list(c), 1, opts).iteration_s for c in itertools.combinations(range(1, 6), 2))
    assert 0.95 * best <= scenario_lower_bound(profile, 1, opts) <= best * (1 + 1e-12)


def test_one_stage_per_device_counts_the_span_around_the_first_wait():
    """1F1B, three devices, two heavy units first and 40 kB activations over 1 MB/s: the first rank runs
    two forwards while micro-batch 0 crosses the later stages and comes back, and waits for the rest of
    it on its own batches' messages. The bound filled that wait with m - 1 forwards and counted no
    message inside it: 60 % of the best split's step; with the list's counts (its span) 84 %."""
    profile = synthetic_profile([5e-3, 5e-3, 1e-4, 1e-3], [15e-3, 10e-3, 1e-4, 1e-3], [0] * 4, [0] * 4,
                                [40_000, 0, 40_000], sizes=(1,))
    opts = CostOptions(pipeline_ranks=3, global_batch=4, schedule="1f1b", bandwidth=1e6, optimizer="sgd")
    best = min(evaluate(profile, list(c), 1, opts).iteration_s for c in itertools.combinations(range(1, 4), 2))
    assert 0.84 * best <= scenario_lower_bound(profile, 1, opts) <= best * (1 + 1e-12)


@pytest.mark.parametrize("schedule,v,p", [("1f1b", 1, 2), ("gpipe", 1, 3), ("interleaved", 2, 2), ("zb-v", 2, 2)])
def test_the_bound_counts_each_rank_s_optimizer_step(schedule, v, p):
    """Six units of microseconds whose AdamW steps take a millisecond each: a rank's step after its list is
    most of the iteration. The bound counted none of it (10-15 % of the best split's step); each rank's
    own term and the ranks' mean now add it (95 % and more)."""
    profile = synthetic_profile([1e-5] * 6, [2e-5] * 6, [1000] * 6, [0] * 6, [100] * 5, sizes=(1,))
    for unit in profile.units:
        unit.optimizer_s = {"adamw": 1e-3, "sgd": 2e-4}
    opts = CostOptions(pipeline_ranks=p, global_batch=4, schedule=schedule, virtual_stages=v, optimizer="adamw")
    best = min(evaluate(profile, list(c), 1, opts).iteration_s
               for c in itertools.combinations(range(1, 6), opts.num_stages - 1))
    assert 0.94 * best <= scenario_lower_bound(profile, 1, opts) <= best * (1 + 1e-12)
