"""What each rank's own list takes (planner.solve.rank_busy): the counts read from the lists, the
inequality every rank's end satisfies, and the scenario bound it gives where messages set the step."""
import itertools
import random

import pytest

from planner.cost.model import evaluate, step_shape
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.cost.step import step_graph, step_lists
from planner.pipeline.actions import COMM_KINDS, SENDS, ActionKind
from planner.pipeline.stepgraph import batches_of
from planner.solve.rank_busy import CutWaits, rank_busy
from planner.solve.scenario_bound import scenario_lower_bound
from tests.support.synthetic import random_chain, synthetic_profile

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3), ("bfs", 2), ("zb-v", 2)]


def test_1f1b_counts_every_blocking_batch_once_with_its_sends():
    """Under 1F1B a batch often sends one message and receives another at the same cut (the steady
    state's activation out, gradient in): it waits for the longer of the two, not the receive alone."""
    busy = rank_busy(CostOptions(pipeline_ranks=3, global_batch=5, schedule="1f1b"), 5)
    act, grad, pair = frozenset({"act"}), frozenset({"grad"}), frozenset({"act", "grad"})
    assert busy.starts == ({}, {act: 3, pair: 2}, {act: 2, pair: 3})
    assert busy.ends == ({grad: 3, pair: 2}, {grad: 2, pair: 3}, {})
    assert busy.both == ({}, {}, {})
    assert busy.operations == (10, 20, 10)  # a send and a receive per micro-batch and boundary
    assert busy.filling == (2, 1, 0)  # the warm-up forwards before each stage's first backward


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_each_blocking_batch_weighs_one(schedule, v):
    """A batch receiving two messages waits for the longer, not for both: its receives together weigh
    one (each half, or one `together` max) -- counting both in full overstated a rank's wait."""
    for p, m in ((2, 4), (3, 6), (4, 8)):
        opts = CostOptions(pipeline_ranks=p, global_batch=m, schedule=schedule, virtual_stages=v)
        busy = rank_busy(opts, m)
        shape = step_shape(opts, m)
        for r, actions in enumerate(step_lists(shape)):
            blocking = sum(1 for item in batches_of(actions) if isinstance(item, tuple)
                           and any(a.kind not in SENDS for a in item))
            own = [g for g in range(opts.num_stages) if shape.rank_of(g) == r]
            weight = sum(busy.weight(g) for g in own)
            assert weight == pytest.approx(blocking), (schedule, p, r)
    if schedule == "zb-h1":  # its batches that receive an activation and a gradient of one stage
        assert any(rank_busy(CostOptions(pipeline_ranks=3, global_batch=6, schedule=schedule), 6).both)


@pytest.mark.parametrize("seed", range(42))
def test_each_rank_ends_after_its_computes_and_waits(seed):
    """The inequality the bound rests on, split by split: a rank's end is at least its computes plus,
    per stage it runs, B_g's waits at the stage's cuts (CutWaits.matrix)."""
    rng = random.Random(seed)
    schedule, v = SCHEDULES[seed % len(SCHEDULES)]
    p = rng.randint(2, 3)
    L = rng.randint(p * v, p * v + 3)
    profile = random_chain(rng, L, sizes=(2,))
    opts = CostOptions(pipeline_ranks=p, global_batch=2 * p * rng.choice([1, 2, 3]), schedule=schedule,
                       virtual_stages=v, bandwidth=rng.choice([5e1, 5e3, 1e8]), message_s=rng.choice([0.0, 1e-4]),
                       latency=rng.choice([0.0, 1e-4]), optimizer="sgd")
    m, S = opts.global_batch // 2, opts.num_stages
    waits = CutWaits(rank_busy(opts, m), range_costs(profile, 2, "sgd"), opts, L)
    for cuts in itertools.islice(itertools.combinations(range(1, L), S - 1), 12):
        cost = evaluate(profile, list(cuts), 2, opts)
        shape = step_shape(opts, m, cost.collectives)
        ends = step_graph(shape).run(cost.durations).rank_end_s
        starts, stops = (0, *cuts), (*cuts, L)
        for r, actions in enumerate(step_lists(shape)):
            computes = sum(cost.durations[(a.kind.value, a.stage)] for a in actions
                           if a.kind not in COMM_KINDS and a.kind != ActionKind.OPTIMIZER_STEP)
            waited = sum(waits.matrix(g)[starts[g], stops[g]] for g in range(S) if shape.rank_of(g) == r)
            assert ends[r] >= (computes + waited) * (1 - 1e-12), (r, ends[r], computes, waited)


@pytest.mark.parametrize("seed", range(40))
def test_the_scenario_bound_holds_where_messages_set_the_step(seed):
    rng = random.Random(seed)
    schedule, v = SCHEDULES[seed % len(SCHEDULES)]
    p = rng.randint(1, 3)
    L = rng.randint(p * v, min(8, p * v + 3))
    profile = random_chain(rng, L, sizes=(1, 2))
    opts = CostOptions(pipeline_ranks=p, global_batch=2 * p * rng.choice([1, 2]), schedule=schedule,
                       virtual_stages=v, bandwidth=rng.choice([2e2, 2e3, 2e5]), message_s=rng.choice([0.0, 1e-3]),
                       latency=rng.choice([0.0, 1e-3]), recompute=rng.choice(["none", "all"]), optimizer="sgd")
    redo = list(range(L)) if opts.recompute == "all" else []
    for b in (1, 2):
        best = min(evaluate(profile, list(cuts), b, opts, redo).iteration_s
                   for cuts in itertools.combinations(range(1, L), opts.num_stages - 1))
        assert scenario_lower_bound(profile, b, opts) <= best * (1 + 1e-12)


@pytest.mark.parametrize("schedule,v,p,least", [("interleaved", 2, 2, 0.6), ("bfs", 2, 2, 0.7), ("zb-v", 2, 2, 0.6),
                                                ("1f1b", 1, 3, 0.8), ("zb-h1", 1, 3, 0.45)])
def test_the_scenario_bound_sees_the_messages(schedule, v, p, least):
    """Six light units whose cuts carry 4 KiB a sample over 1 MB/s: the messages set the step. With
    several stages per device the bound was the busiest rank's share of the computes, 3 % of the best
    split's step (25 % and 18 % with one stage per device); each rank's waits at its cuts make it 45-80 %."""
    profile = synthetic_profile([1e-4] * 6, [1e-4] * 6, [0] * 6, [0] * 6, [4096] * 5)
    opts = CostOptions(pipeline_ranks=p, global_batch=8, schedule=schedule, virtual_stages=v, bandwidth=1e6,
                       optimizer="sgd")
    best = min(evaluate(profile, list(cuts), 1, opts).iteration_s
               for cuts in itertools.combinations(range(1, 6), opts.num_stages - 1))
    assert least * best <= scenario_lower_bound(profile, 1, opts) <= best * (1 + 1e-12)
