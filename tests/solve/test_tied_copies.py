"""The integer program counts a tied weight once per rank, as the cost model does (planner.cost.ties):
its answers agree with brute force where the one copy decides (memory, exchange, its latency)."""
import pulp
import pytest

from planner.cost.model import compute_profile, evaluate
from planner.cost.options import CostOptions
from planner.cost.placement import Placement
from planner.cost.topology_file import topology_from_json
from planner.solve.api import solve
from planner.solve.ilp import Program, big_m_ms
from planner.solve.ilp_split import MS, NoSplit
from tests.support.synthetic import synthetic_profile

TIE = 4 << 20  # the tied embedding: in the first unit and in the head, as a capture counts it
BLOCK = 1 << 20


def tied_chain(blocks=(BLOCK, BLOCK, BLOCK), trainable_blocks=True):
    params = [TIE, *blocks, TIE]
    L = len(params)
    profile = synthetic_profile([0.002 + 0.0005 * (i % 3) for i in range(L)], [0.004 + 0.001 * (i % 2) for i in range(L)],
                                params, [1 << 20] * L, [1 << 16] * (L - 1), sizes=(1, 2),
                                names=["embed"] + [f"b{i}" for i in range(len(blocks))] + ["head"])
    for u in profile.units:
        u.optimizer_s = {"sgd": u.param_bytes / BLOCK * 1e-4}
        if not trainable_blocks and u.name.startswith("b"):
            u.trainable_bytes = 0
    profile.extra["shared_parameters"] = [{"name": "wte", "units": ["embed", "head"], "bytes": TIE}]
    return profile


def same_as_brute(profile, opts):
    ilp = solve(profile, opts)
    brute = solve(profile, opts, method="brute")
    assert ilp.objective == pytest.approx(brute.objective, rel=1e-6) and ilp.status == "optimal"
    assert ilp.bound <= brute.objective * (1 + 1e-9)  # the program's bound is a valid one
    assert evaluate(profile, ilp.boundaries, ilp.micro_batch_size, opts, ilp.recompute).iteration_s == \
        pytest.approx(ilp.objective, rel=1e-9)
    return ilp


TOPOLOGY = {"levels": [{"name": "site", "count": 2, "bandwidth": 1e7, "latency": 0.02},
                       {"name": "device", "count": 2, "bandwidth": 1e9, "latency": 0.0}]}
ACROSS_SITES = Placement(topology_from_json(TOPOLOGY), ((0, 1), (2, 3)))  # each rank's replicas on both sites


@pytest.mark.parametrize("frozen_blocks, boundaries, options", [
    (False, [], dict(pipeline_ranks=1)),
    (False, [2], dict(pipeline_ranks=2)),
    (False, [1, 2, 4], dict(pipeline_ranks=2, schedule="zb-v", virtual_stages=2)),
    (False, [2], dict(pipeline_ranks=2, sync_every=3)),  # local SGD: the averaging covers each held copy
    (True, [2], dict(pipeline_ranks=2, latency=0.02, placement=ACROSS_SITES)),
    (True, [1, 2, 4], dict(pipeline_ranks=2, schedule="zb-v", virtual_stages=2, latency=0.02,
                           placement=ACROSS_SITES)),
])
def test_the_program_at_a_split_is_the_model_there(frozen_blocks, boundaries, options):
    """Every split fixed: the program's exchange, step, tie and memory are the cost model's."""
    program_is_the_model(tied_chain(trainable_blocks=not frozen_blocks), boundaries, options)


def program_is_the_model(profile, boundaries, options):
    profile = compute_profile(profile, CostOptions(1, 8))
    opts = CostOptions(data_parallel=2, global_batch=8 * options["pipeline_ranks"], dp_bandwidth=2e8, **options)
    cost = evaluate(profile, boundaries, 1, opts)
    edges = [0, *boundaries, profile.num_units]
    stage = [g for g in range(len(edges) - 1) for _ in range(edges[g], edges[g + 1])]
    for cap, fits in ((max(cost.device_memory), True), (max(cost.device_memory) - 2 ** 14, False)):
        try:
            program = Program(profile, 1, opts.with_(memory_cap=cap), stage, stage)
        except NoSplit:  # a rank without tie variables over its cap: its row is a constant
            assert not fits
            continue
        program.add_form(cost.critical_path, big_m_ms(profile, 1, opts, cost.critical_path))
        found = program.solve(None, None, "highs")
        assert found.below_cutoff == fits
        if fits:
            assert found.value_s == pytest.approx(cost.iteration_s, rel=1e-9)
            for term, seconds in cost.durations.items():
                if term[0] in ("reduce", "step", "tie"):
                    assert pulp.value(program.term[term]) == pytest.approx(seconds * MS, rel=1e-9, abs=1e-9), term


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("boundaries, options", [
    ([], dict(pipeline_ranks=1)),  # both uses on the rank: kept whole, never gathered
    ([2], dict(pipeline_ranks=2)),  # one use a rank: spanning (trainable) or sharded (frozen)
    ([1, 2, 4], dict(pipeline_ranks=2, schedule="zb-v", virtual_stages=2)),  # both on rank 0 (the V)
    ([2], dict(pipeline_ranks=2, latency=0.02, placement=ACROSS_SITES)),
])
def test_the_program_at_a_split_is_the_model_there_under_zero3(frozen, boundaries, options):
    # before the fix the program charged a tie its rank keeps whole as sharded, as the model did
    program_is_the_model(frozen_tie_chain() if frozen else tied_chain(), boundaries,
                         dict(options, shard="parameters"))


def _one_rank_holding_both_uses(chain):
    """The tied `chain()` on one rank (d = 2), the same chain as the runtime holds it (the head's
    weight is the embedding's: no second copy), and the memory of the latter: the cap that fits."""
    profile, unique = chain(), chain()
    unique.units[-1].param_bytes = unique.units[-1].trainable_bytes = 0
    unique.extra["shared_parameters"] = []
    opts = CostOptions(pipeline_ranks=1, data_parallel=2, global_batch=8, dp_bandwidth=1e9)
    return profile, unique, opts, evaluate(unique, [], 2, opts).device_memory[0]


def test_one_rank_fits_where_it_holds_one_copy_of_the_tie():
    # before the fix both copies were counted: no plan fitted this cap (InfeasibleError)
    profile, unique, opts, cap = _one_rank_holding_both_uses(tied_chain)
    found = same_as_brute(profile, opts.with_(memory_cap=cap))
    assert evaluate(profile, [], 2, opts).device_memory == [cap] and found.cost.device_memory[0] <= cap


@pytest.mark.parametrize("schedule, v, p", [("1f1b", 1, 2), ("1f1b", 1, 3), ("zb-v", 2, 2), ("interleaved", 2, 2)])
def test_solver_matches_brute_force_where_the_tie_spans_ranks_or_not(schedule, v, p):
    profile = tied_chain(blocks=(BLOCK, 2 * BLOCK, BLOCK, BLOCK))
    opts = CostOptions(pipeline_ranks=p, data_parallel=2, global_batch=8 * p, schedule=schedule, virtual_stages=v,
                       dp_bandwidth=2e8, bandwidth=1e9)
    free = same_as_brute(profile, opts)
    cap = sorted(max(evaluate(profile, boundaries, 1, opts).device_memory) for boundaries in _splits(profile, opts))[1]
    same_as_brute(profile, opts.with_(memory_cap=cap))  # the cap rules out the split of least memory but one
    assert free.objective > 0


def _splits(profile, opts):
    import itertools
    S, L = opts.num_stages, profile.num_units
    return [list(c) for c in itertools.combinations(range(1, L), S - 1)]


def test_a_rank_whose_only_trained_weight_is_a_spanning_tie_exchanges_nothing():
    # frozen blocks: a rank holding the embedding (or the head) alone, the tie spanning ranks, runs
    # no data-parallel collective and pays no ring latency
    profile = tied_chain(trainable_blocks=False)
    opts = CostOptions(pipeline_ranks=2, data_parallel=2, global_batch=8, latency=0.02, placement=ACROSS_SITES)
    cost = evaluate(profile, [2], 1, opts)
    assert cost.durations[("reduce", 0)] == 0.0 and cost.durations[("reduce", 1)] == 0.0
    same_as_brute(profile, opts)


def test_the_memory_floor_counts_a_tie_once_per_stage():
    """The diagnosis' least memory per device (planner.solve.diagnose.min_memory_plan) is the least
    over every split and micro-batch size of the model's peak, which holds one copy of a tie per
    rank. Units of 2, 4, 4 and 1 MiB, the two middle ones one tied weight, two stages: the least is
    the split that keeps the tie together (4 + 1); counting both copies (as the diagnosis did) made
    it pick 2 + 4 | 4 + 1 instead, and report that split's larger peak."""
    import itertools

    from planner.cost.model import candidate_micro_batch_sizes
    from planner.solve.diagnose import min_memory_plan

    params = [2 * BLOCK, 4 * BLOCK, 4 * BLOCK, BLOCK]
    profile = synthetic_profile([0.002] * 4, [0.004] * 4, params, [1 << 10] * 4, [1 << 10] * 3, sizes=(1, 2),
                                names=["a", "t1", "t2", "d"])
    profile.extra["shared_parameters"] = [{"name": "w", "units": ["t1", "t2"], "bytes": 4 * BLOCK}]
    opts = CostOptions(pipeline_ranks=2, global_batch=4, optimizer="sgd")
    profile = compute_profile(profile, opts)
    peaks = {(cut, b): max(evaluate(profile, [cut], b, opts).device_memory)
             for (cut,) in itertools.combinations(range(1, 4), 1)
             for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts)}
    best = min(peaks.values())
    floor = min_memory_plan(profile, opts)
    assert floor.boundaries == [1] and floor.memory_bytes == pytest.approx(best, rel=1e-12)


def frozen_tie_chain():
    """tied_chain with the tied embedding frozen: in both units' parameters, in neither's trainable bytes."""
    profile = tied_chain()
    for u in (profile.units[0], profile.units[-1]):
        u.trainable_bytes -= TIE
    profile.extra["shared_parameters"] = [dict(profile.extra["shared_parameters"][0], trainable=False)]
    return profile


def test_a_frozen_tie_is_held_once_per_rank():
    # before the fix a frozen tie was no tie to the model: one rank holding both uses was charged two
    # copies (runtime.stage holds one parameter object), and no plan fitted the cap below
    profile, unique, opts, cap = _one_rank_holding_both_uses(frozen_tie_chain)
    assert evaluate(profile, [], 2, opts).device_memory == [cap]
    assert evaluate(profile, [], 2, opts).stages[0].param_bytes == evaluate(unique, [], 2, opts).stages[0].param_bytes
    same_as_brute(profile, opts.with_(memory_cap=cap))
    spread = CostOptions(pipeline_ranks=2, data_parallel=2, global_batch=16, dp_bandwidth=2e8, bandwidth=1e9)
    assert ("tie", "wte") not in evaluate(profile, [2], 1, spread).durations  # nothing to all-reduce
    caps = sorted(max(evaluate(profile, list(c), 1, spread).device_memory) for c in _splits(profile, spread))
    same_as_brute(profile, spread.with_(memory_cap=caps[1]))


@pytest.mark.parametrize("shard, p, schedule, v", [("gradients", 2, "1f1b", 1), ("parameters", 2, "1f1b", 1),
                                                   ("parameters", 2, "interleaved", 2), ("gradients", 3, "1f1b", 1)])
@pytest.mark.parametrize("frozen", [False, True])
def test_solver_matches_brute_force_where_zero_keeps_a_tie_whole(shard, p, schedule, v, frozen):
    profile = frozen_tie_chain() if frozen else tied_chain()
    profile.units[2].param_bytes = profile.units[2].trainable_bytes = 2 * BLOCK
    opts = CostOptions(pipeline_ranks=p, data_parallel=2, global_batch=8 * p, schedule=schedule, virtual_stages=v,
                       dp_bandwidth=2e8, bandwidth=1e9, shard=shard)
    peaks = sorted({max(evaluate(profile, c, 1, opts).device_memory) for c in _splits(profile, opts)})
    for cap in peaks[1:3]:  # caps that rule out some splits
        same_as_brute(profile, opts.with_(memory_cap=cap))


def test_zero3_ties_go_to_the_program_not_the_branch_and_bound():
    # the branch and bound's stage terms charge every use's gathers; under ZeRO-3 a frozen tie two of
    # a rank's units use is gathered for none (planner.cost.ties): a split-dependent term it cannot bound
    from planner.solve.branch import applies
    opts = CostOptions(pipeline_ranks=2, data_parallel=2, global_batch=16)
    assert applies(frozen_tie_chain(), opts) and applies(frozen_tie_chain(), opts.with_(shard="gradients"))
    assert not applies(frozen_tie_chain(), opts.with_(shard="parameters"))
