"""The integer program's memory rows against `evaluate`, split by split and recomputation set (of up to two
units) by set: the program with one split and one set fixed fits each rank's cap at its peak and none a
millionth below it (the solver's tolerances: bytes). The oracle tests (brute force) see a term only where the
optimum sits on it; this sees every term each set touches."""
import itertools
import random

from unittest import mock

import numpy as np
import pulp
import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.cost.rank_memory import fixed_bytes
from planner.cost.ranges import RangeCosts, range_costs
from planner.solve.chain_recompute import worth_recomputing
from planner.solve.ilp import Program
from planner.solve.ilp_split import NoSplit
from tests.solve.test_zero_bubble import _chain
from tests.support.synthetic import keep_read, let_go, random_chain, receive_apart, share_kept, views_apart

L = 5


def _fits(profile, b, opts, cuts, redo, caps) -> bool:
    """Whether the program with this split and these units recomputed meets its memory rows with each rank's
    device holding at most caps[i] (None: no row); None where it has no choice to recompute one of them
    (chain_recompute.frees_somewhere)."""
    stage = [sum(1 for k in cuts if k <= l) for l in range(L)]
    fixed = fixed_bytes(profile, opts)
    rows = [None if cap is None else cap - fixed for cap in caps]
    with mock.patch("planner.cost.stage_memory.rank_caps", lambda *args: rows):
        try:
            program = Program(profile, b, opts, stage, stage)
        except NoSplit:
            return False
    if any((l, stage[l]) not in program.rho for l in redo):
        return None
    for (l, g), r in program.rho.items():
        program.add(r == (1 if l in redo else 0), f"fix_{l}_{g}")
    program.prob.solve(pulp.HiGHS(msg=False) if pulp.HiGHS().available() else pulp.PULP_CBC_CMD(msg=False))
    return program.prob.status == pulp.LpStatusOptimal


def _zero_bubble_chain(seed: int):
    """Kept gradients measured (even seeds), frozen units, inputs received apart, shares let go."""
    profile = _chain(seed, L, frozen=True)
    rng = random.Random(seed)
    receive_apart(profile, [l for l in range(L) if rng.random() < 0.5], rng)
    let_go(profile, range(1, L), rng)
    return profile


@pytest.mark.parametrize("schedule,ranks,seed", [("zb-h1", 2, 12), ("zb-h1", 3, 24), ("zb-v", 2, 16), ("1f1b", 2, 3),
                                                 ("gpipe", 3, 5)])
def test_the_memory_rows_equal_evaluate_on_every_split_and_recomputation_set(schedule, ranks, seed):
    if schedule.startswith("zb"):
        profile = _zero_bubble_chain(seed)
    else:
        profile = random_chain(random.Random(seed), L, sizes=(2,), apart=True)
    _rows_equal_evaluate(profile, schedule, ranks)


@pytest.mark.parametrize("schedule,ranks,seed", [("zb-h1", 2, 12), ("zb-h1", 3, 13), ("zb-v", 2, 16), ("1f1b", 2, 7)])
def test_the_memory_rows_equal_evaluate_where_recomputed_neighbours_keep_one_value(schedule, ranks, seed):
    # units reading one value made before them (a gate every layer multiplies by) each keep it recomputed: two
    # neighbours recomputed hold it once (q_k), and a unit after a recomputed one that saves it too (u_k).
    # The rows' pair of recomputed neighbours and their shared_lost less u_k
    rng = random.Random(seed)
    profile = _zero_bubble_chain(seed) if schedule.startswith("zb") else \
        random_chain(rng, L, sizes=(2,), apart=True)
    keep_read(profile, range(1, L), rng)
    costs = RangeCosts(profile, 2)
    assert (costs.shares[:, 1, 1] > costs.redo_dup).any() and (costs.shares[:, 1, 0] > 0).any()
    _rows_equal_evaluate(profile, schedule, ranks)


@pytest.mark.parametrize("schedule,ranks,seed", [("zb-h1", 2, 12), ("1f1b", 2, 7), ("gpipe", 3, 5)])
def test_the_memory_rows_equal_evaluate_where_units_apart_save_one_storage(schedule, ranks, seed):
    # units 0 and 2, and 1 and 4, save one storage that no unit between them saves (planner.cost.ranges' gap): the
    # rows take it off where the stage holds both and recomputes none of the units from one to the other
    rng = random.Random(seed)
    profile = _zero_bubble_chain(seed) if schedule.startswith("zb") else \
        random_chain(rng, L, sizes=(2,), apart=True)
    for l, j in ((0, 2), (1, 4)):
        for unit in (profile.units[l], profile.units[j]):
            size = 64 * rng.randint(1, 64)
            unit.saved_bytes[2] += size
            unit.shared_saved_bytes.setdefault(2, {})[f"apart{l}"] = size
    costs = RangeCosts(profile, 2)
    assert [(l, j) for l, j, _ in costs.gaps] == [(0, 2), (1, 4)]
    _rows_equal_evaluate(profile, schedule, ranks)


@pytest.mark.parametrize("schedule,ranks,seed", [("zb-h1", 2, 12), ("zb-h1", 3, 24), ("zb-v", 2, 16), ("1f1b", 2, 7),
                                                 ("gpipe", 3, 5)])
def test_the_memory_rows_equal_evaluate_where_a_stage_receives_views_apart(schedule, ranks, seed):
    # views of one storage crossing cuts 1 .. 3 and 3 .. 4 (a coupling layer's halves): a stage starting there
    # holds each view apart (planner.cost.received); the rows add each start's difference where the stage starts
    # there, recomputed units and pairs of them included
    rng = random.Random(seed)
    profile = _zero_bubble_chain(seed) if schedule.startswith("zb") else \
        random_chain(rng, L, sizes=(2,), apart=True)
    views_apart(profile, 1, 3, rng)
    views_apart(profile, 3, 4, rng, parts=3)
    assert sorted(RangeCosts(profile, 2).views) == [1, 2, 3, 4]
    _rows_equal_evaluate(profile, schedule, ranks)


def _rows_equal_evaluate(profile, schedule, ranks):
    base = CostOptions(pipeline_ranks=ranks, virtual_stages=2 if schedule == "zb-v" else 1, global_batch=8,
                       schedule=schedule, bandwidth=1e9, recompute="auto", memory_cap=1e15)  # (rows: `_fits`)
    b, checked = 2, 0
    for cuts in itertools.combinations(range(1, L), base.num_stages - 1):
        for size in range(3):
            for redo in itertools.combinations(range(L), size):
                held = evaluate(profile, list(cuts), b, base, list(redo)).device_memory
                fits = _fits(profile, b, base, cuts, redo, [peak * (1 + 1e-9) for peak in held])
                if fits is None:
                    continue
                assert fits, (cuts, redo)
                for i, peak in enumerate(held):  # each rank's rows, the others free
                    caps = [peak * (1 - 1e-6) if j == i else None for j in range(ranks)]
                    assert not _fits(profile, b, base, cuts, redo, caps), (cuts, redo, i)
                checked += 1
    assert checked > 10


def _with_units_saving_their_inputs(seed: int):
    """A random chain where some units save only what they keep when recomputed (an activation
    reading its input alone): recomputing them frees nothing in a stage, or only where they start
    one (their inputs received apart: first_a) or after a unit holding one of their inputs (r_l)."""
    rng = random.Random(seed)
    profile = random_chain(rng, 6, sizes=(2,), frozen=True, apart=True)
    share_kept(profile, [k for k in range(1, 6) if rng.random() < 0.5], rng)
    costs = RangeCosts(profile, 2)  # not range_costs: its cache would keep these costs for the changed profile
    for l, unit in enumerate(profile.units):
        saved = unit.saved_bytes[2] + int(costs.inputs[l] - costs.s[l])  # s_l = in_l
        if rng.random() < 0.5 and saved >= sum(unit.shared_saved_bytes.get(2, {}).values()):
            if unit.first_saved_bytes:  # half of them: nothing more where they start a stage either
                unit.first_saved_bytes[2] = saved + (unit.first_saved_bytes[2] - unit.saved_bytes[2]) * (l % 2)
            unit.saved_bytes[2] = saved
    return profile


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_a_unit_recomputation_is_not_weighed_for_never_lowers_memory_or_time(schedule, virtual):
    # brute force (the oracle) and the program both try only chain_recompute.worth_recomputing's units: every
    # set on these chains, each such unit added to it, leaves every rank's memory and the step no lower
    opts = CostOptions(pipeline_ranks=2, virtual_stages=virtual, global_batch=8, schedule=schedule, bandwidth=1e9,
                       recompute="auto", memory_cap=1e15)
    checked = 0
    for seed in range(6):
        profile = _with_units_saving_their_inputs(seed)
        unworthy = np.flatnonzero(~worth_recomputing(range_costs(profile, 2), schedule)).tolist()
        for cuts in itertools.combinations(range(1, 6), opts.num_stages - 1):
            for size in range(7):
                for redo in itertools.combinations(range(6), size):
                    base = evaluate(profile, list(cuts), 2, opts, list(redo))
                    for l in set(unworthy) - set(redo):
                        more = evaluate(profile, list(cuts), 2, opts, sorted(redo + (l,)))
                        assert more.iteration_s >= base.iteration_s * (1 - 1e-12), (seed, cuts, redo, l)
                        assert all(a >= b * (1 - 1e-12) for a, b in zip(more.device_memory, base.device_memory)), \
                            (seed, cuts, redo, l, more.device_memory, base.device_memory)
                        checked += 1
    assert checked > 100


@pytest.mark.parametrize("schedule,ranks,seed,read", [("zb-h1", 2, 12, False), ("zb-h1", 3, 24, False),
                                                      ("zb-h1", 2, 16, False), ("zb-h1", 2, 12, True)])
def test_every_unit_recomputed_the_stage_tables_equal_evaluate(schedule, ranks, seed, read):
    # zero bubble, kept gradients measured, every unit recomputed: a later stage's weight part holds each unit's
    # in'^h_l and its kept gradients k_l, the r^h_k shared with the unit before once. The tables the branch and
    # bound and the program read counted in'^h_l alone (11.7-18.3 MB short on the oracle campaign's chains)
    from planner.solve.diagnose import memory_matrices

    profile = _zero_bubble_chain(seed)
    if read:  # (each recomputed unit keeping a value its neighbour keeps too: q_k, held once)
        keep_read(profile, range(1, L), random.Random(seed))
    opts = CostOptions(pipeline_ranks=ranks, global_batch=8, schedule=schedule, bandwidth=1e9, recompute="all")
    assert range_costs(profile, 2).kept_known
    matrices = memory_matrices(profile, 2, opts)  # (one stage per rank: each stage's table is its rank's)
    for cuts in itertools.combinations(range(1, L), opts.num_stages - 1):
        edges = (0, *cuts, L)
        held = evaluate(profile, list(cuts), 2, opts, list(range(L))).device_memory
        assert [float(matrices(g)[edges[g], edges[g + 1]]) for g in range(ranks)] == pytest.approx(held, rel=1e-12)
