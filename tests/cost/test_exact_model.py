"""One model: the plan's time and memory are those of the lists the runtime executes, and the
solver optimises exactly that (issue 18).

- predicted iteration == the simulation of the runtime's own lists (instruction_lists of the plan
  file), for random profiles and every schedule;
- planned activation memory per rank == the peak along the runtime's list, counted here by a
  plain walk (not planner.pipeline.stepgraph.held_peaks);
- the solver's plan == brute force over every split under the exact model (L <= 8).
"""
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.fidelity.simulation import simulate_plan
from planner.pipeline.schedule import ActionKind
from planner.plan.make import make_plan
from planner.solve.api import solve
from planner.solve.brute import solve_brute
from planner.solve.diagnose import InfeasibleError
from planner.solve.solution import Solution
from tests.support.solvers import both_solvers_match_brute_force
from tests.support.synthetic import drawn_chain

TIE = 800  # bytes of the tied weight some problems share between their first and last units
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("bfs", 2), ("interleaved", 3), ("bfs", 3),
             ("zb-h1", 1), ("zb-v", 2)]


@st.composite
def problems(draw, max_units=8):
    L = draw(st.integers(3, max_units))
    profile = drawn_chain(draw, L)
    if draw(st.booleans()):  # the backward timed in two parts (else planner.cost.ranges estimates them)
        for u in profile.units:
            share = draw(st.sampled_from([0.2, 0.5, 0.7]))
            u.backward_input_s = {b: (1 - share) * t for b, t in u.backward_s.items()}
            u.backward_weight_s = {b: share * t * draw(st.sampled_from([0.8, 1.0])) for b, t in u.backward_s.items()}
            u.weight_held_bytes = {b: s // draw(st.sampled_from([1, 2, 4])) for b, s in u.saved_bytes.items()}
    if draw(st.booleans()) and L >= 3:
        trainable = draw(st.sampled_from([True, True, False]))  # a frozen tie: held once, never all-reduced
        profile.extra["shared_parameters"] = [{"name": "tied", "units": [profile.units[0].name,
                                                                           profile.units[-1].name], "bytes": TIE,
                                               "trainable": trainable}]
        for u in (profile.units[0], profile.units[-1]):  # as a capture counts it: in each unit using it
            u.param_bytes += TIE
            u.trainable_bytes += TIE if trainable else 0
    schedule, v = draw(st.sampled_from(SCHEDULES))
    p = draw(st.integers(1, max(1, min(3, L // v))))
    d = draw(st.sampled_from([1, 1, 2]))
    m_unit = p if schedule == "interleaved" else 1
    global_batch = d * 4 * m_unit * draw(st.sampled_from([1, 2]))
    opts = CostOptions(pipeline_ranks=p, global_batch=global_batch, schedule=schedule, virtual_stages=v,
                       data_parallel=d, bandwidth=draw(st.sampled_from([2e5, 1e6, 1e8])),
                       latency=draw(st.sampled_from([0.0, 5e-5])), message_s=draw(st.sampled_from([0.0, 2e-5])),
                       optimizer=draw(st.sampled_from(["sgd", "adamw"])),
                       memory_cap=draw(st.sampled_from([None, None, 6000.0, 12000.0, 30000.0])),
                       recompute=draw(st.sampled_from(["none", "none", "auto", "all"])),
                       step_overhead_s=draw(st.sampled_from([0.0, 1e-3])),
                       # ZeRO-3: a tie one rank holds twice (p = 1, zb-v) is kept whole there
                       shard=draw(st.sampled_from(["none", "parameters"])) if d > 1 else "none")
    return profile, opts


def _plan_of(profile, opts, boundaries, b, recompute=()):
    cost = evaluate(profile, boundaries, b, opts, recompute)
    solution = Solution(boundaries=list(boundaries), micro_batch_size=b, num_micro_batches=cost.num_micro_batches,
                        cost=cost, status="feasible", objective=cost.iteration_s, bound=0.0, gap=1.0, seconds=0.0,
                        method="test", backend="python", recompute=list(recompute), options=opts)
    return cost, make_plan(profile, solution, opts, "p.json")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.randoms(use_true_random=False))
def test_prediction_is_the_simulation_of_the_runtime_lists(problem, rng):
    profile, opts = problem
    L, S = profile.num_units, opts.num_stages
    boundaries = sorted(rng.sample(range(1, L), S - 1))
    b = rng.choice([b for b in (1, 2, 4) if opts.global_batch % (opts.data_parallel * b) == 0
                    and (opts.schedule != "interleaved" or (opts.global_batch // (opts.data_parallel * b))
                         % opts.pipeline_ranks == 0)])
    cost, plan = _plan_of(profile, opts.with_(memory_cap=None), boundaries, b)
    simulated = simulate_plan(plan)
    assert math.isclose(simulated.iteration_s, cost.iteration_s, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(plan.predicted_iteration_s, cost.iteration_s, rel_tol=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.randoms(use_true_random=False))
def test_screening_many_splits_at_once_is_evaluate(problem, rng):
    # the search simulates many splits in one vectorised run (planner.cost.step.run_many): the same step,
    # to the bit, and the same longest path as evaluate, split by split (ties, collectives included)
    from planner.cost.model import simulate_splits

    profile, opts = problem
    L, S = profile.num_units, opts.num_stages
    assume(opts.schedule != "interleaved" or (opts.global_batch // opts.data_parallel) % opts.pipeline_ranks == 0)
    b = 1
    splits = [(sorted(rng.sample(range(1, L), S - 1)), sorted(rng.sample(range(L), rng.randint(0, L))))
              for _ in range(6)] + [([L] * S, [])]  # the last one is not a split (S cuts)
    screened = simulate_splits(profile, splits, b, opts)
    assert screened[-1] is None
    for (boundaries, redo), found in zip(splits[:-1], screened):
        cost = evaluate(profile, boundaries, b, opts, redo)
        assert found == (cost.iteration_s, cost.critical_path)


def _walk_peak(actions, held_bytes):
    """Most bytes held at once along one rank's list: saved tensors of the micro-batches forwarded and
    not yet backwarded, received activations not yet forwarded, received gradients not yet used,
    (zero-bubble) what the weight backward reads, from the input backward until it runs, and the
    messages of a batch of sends only until the rank's next batch begins."""
    live, peak, unsent = 0.0, 0.0, 0.0
    comm = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)
    for k, a in enumerate(actions):
        g = a.stage
        if a.kind in comm and (k == 0 or actions[k - 1].kind not in comm or actions[k - 1].batch != a.batch):
            live -= unsent  # a new batch: the sends posted before are waited for first
            batch = [x for x in actions if x.kind in comm and x.batch == a.batch]
            unsent = sum(held_bytes[("sent_act", x.stage)] if x.kind == ActionKind.SEND_ACT else
                         held_bytes[("sent_grad", x.stage)] for x in batch) \
                if all(x.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD) for x in batch) else 0.0
            live += unsent
        if a.kind == ActionKind.RECV_ACT:
            live += held_bytes[("inbox", g)]
        elif a.kind == ActionKind.RECV_GRAD:
            live += held_bytes[("gradbox", g)]
        elif a.kind == ActionKind.FORWARD:
            live += held_bytes[("live", g)] - (held_bytes[("inbox", g)] if g > 0 and _was_received(actions, a) else 0)
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            peak = max(peak, live)
            live -= held_bytes[("live", g)] + (held_bytes[("gradbox", g)] if _grad_received(actions, a) else 0)
            if a.kind == ActionKind.BACKWARD_INPUT:  # what the weight part reads stays until it runs
                live += held_bytes[("weight", g)]
        elif a.kind == ActionKind.BACKWARD_WEIGHT:
            peak = max(peak, live)
            live -= held_bytes[("weight", g)]
        peak = max(peak, live)
    return peak


def _was_received(actions, forward):
    return any(a.kind == ActionKind.RECV_ACT and a.stage == forward.stage and a.micro_batch == forward.micro_batch
               for a in actions)


def _grad_received(actions, backward):
    return any(a.kind == ActionKind.RECV_GRAD and a.stage == backward.stage and a.micro_batch == backward.micro_batch
               for a in actions)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.randoms(use_true_random=False))
def test_planned_memory_is_the_peak_along_the_runtime_lists(problem, rng):
    from planner.cost.model import held_bytes, Split
    from planner.cost.ranges import range_costs

    profile, opts = problem
    opts = opts.with_(memory_cap=None, shard="none")  # the unsharded bytes this walk counts
    L, S = profile.num_units, opts.num_stages
    boundaries = sorted(rng.sample(range(1, L), S - 1))
    b = 1
    cost, plan = _plan_of(profile, opts, boundaries, b)
    split = Split(range_costs(profile, b, opts.optimizer), tuple([0] + boundaries + [L]), frozenset())
    per_item = held_bytes(split, opts)
    topology = plan.topology()
    opt = {"sgd": 0.0, "adamw": 2.0, "adam": 2.0}[opts.optimizer]
    for rank, actions in enumerate(plan.instruction_lists()):
        stages = sorted({a.stage for a in actions if a.kind == ActionKind.FORWARD})
        # fp32 SGD/AdamW: a parameter byte holds its weight, a trainable one its gradient and state too
        static = sum(split.costs.params(*split.units(g)) + split.costs.trainable(*split.units(g)) * (1 + opt)
                     for g in stages)
        if profile.extra.get("shared_parameters"):  # the rank holds one copy of the tie, however many uses
            uses = sum(1 for g in stages for l in (0, L - 1) if split.units(g)[0] <= l < split.units(g)[1])
            trains = profile.extra["shared_parameters"][0]["trainable"]
            static -= max(uses - 1, 0) * TIE * (1 + ((1 + opt) if trains else 0))
        assert all(topology.rank_running(g, 0) == rank for g in stages)
        assert math.isclose(cost.device_memory[rank], static + _walk_peak(actions, per_item), rel_tol=1e-12,
                            abs_tol=1e-6)


def _oracle_and_found(profile, opts):
    """(the brute-force optimum, the solver's plan); None where there is nothing to compare: too many
    plans to enumerate (over 1,000: a zero-bubble chain of 7 units tries every recomputation set, 5 s),
    or no plan at all (brute force agreeing)."""
    try:
        oracle = solve_brute(profile, opts, limit=1000)
    except ValueError:
        return None  # too many plans to enumerate
    try:
        found = solve(profile, opts)
    except InfeasibleError:
        assert oracle is None
        return None
    assert oracle is not None
    return oracle, found


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_units=7))
def test_solver_matches_brute_force_under_the_exact_model(problem):
    profile = problem[0]
    compared = _oracle_and_found(*problem)
    if compared is None:
        return
    oracle, found = compared
    assert found.status == "optimal" and found.gap <= 1e-6  # the MIP's own tolerance
    assert math.isclose(found.objective, oracle.objective, rel_tol=1e-9)
    again = evaluate(profile, found.boundaries, found.micro_batch_size, found.options, found.recompute)
    assert again.feasible and math.isclose(again.iteration_s, found.objective, rel_tol=1e-12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_units=7), st.sampled_from([6000.0, 12000.0, 30000.0]))
def test_recompute_auto_under_a_cap_matches_brute_force(problem, cap):
    """The command's default under a cap: the splits' search (with each stage's least recomputation as
    its bound where one stage runs per device, else without recomputation) gives the integer program a
    plan and a bound first (planner.solve.exact._without_recomputation); the result is still the
    optimum, and never slower than the best plan without recomputation."""
    profile, opts = problem
    opts = opts.with_(recompute="auto", memory_cap=cap)
    compared = _oracle_and_found(profile, opts)
    if compared is None:
        return
    oracle, found = compared
    assert found.status == "optimal"
    assert math.isclose(found.objective, oracle.objective, rel_tol=1e-9)
    assert found.bound <= oracle.objective * (1 + 1e-9)
    try:
        plain = solve(profile, opts.with_(recompute="none"))
    except InfeasibleError:
        return
    assert found.objective <= plain.objective * (1 + 1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_units=7))
def test_the_scenario_bound_holds_for_every_plan(problem):
    """The search skips scenarios and certifies gaps with scenario_lower_bound: no split may beat it,
    nor the bound it falls back to past its deadline (every schedule's, O(L))."""
    import itertools

    from planner.cost.model import candidate_micro_batch_sizes
    from planner.solve.scenario_bound import scenario_lower_bound

    profile, opts = problem
    opts = opts.with_(memory_cap=None)
    L, S = profile.num_units, opts.num_stages
    redo = list(range(L)) if opts.recompute == "all" else []
    for b in candidate_micro_batch_sizes(profile, opts.global_batch, opts):
        bound = scenario_lower_bound(profile, b, opts)
        best = min(evaluate(profile, list(split), b, opts, redo).iteration_s
                   for split in itertools.combinations(range(1, L), S - 1))
        assert bound <= best * (1 + 1e-12), (b, bound, best)
        assert scenario_lower_bound(profile, b, opts, deadline=0.0) <= best * (1 + 1e-12), b


def test_the_zero_bubble_scenario_bound_counts_only_activations_before_a_rank():
    """zb-h1, one micro-batch through 3 stages: the last rank waits for the activations crossing
    the boundaries before it, not for the gradients going back (they overlap its weight backwards);
    the bound once charged both and exceeded the best split."""
    import itertools

    from planner.solve.scenario_bound import scenario_lower_bound
    from tests.support.synthetic import synthetic_profile

    f = {1: 0.00390625, 2: 0.0078125, 4: 0.015625}
    g_end = {b: t / 2 for b, t in f.items()}
    profile = synthetic_profile([f] * 5, [g_end, f, f, f, g_end], [0] * 5, [0] * 5, [1, 1, 0, 0])
    opts = CostOptions(pipeline_ranks=3, global_batch=4, schedule="zb-h1", bandwidth=2e5, optimizer="sgd")
    best = min(evaluate(profile, list(split), 4, opts).iteration_s for split in itertools.combinations(range(1, 5), 2))
    bound = scenario_lower_bound(profile, 4, opts)
    assert bound <= best * (1 + 1e-12)
    assert bound >= best * (1 - 1e-3)  # and still tight here


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_units=6))
def test_solver_matches_brute_force_in_mixed_precision(problem):
    """bf16-mixed: 18 B per parameter for the step, the bf16 compute copy once per stage
    (planner.cost.memory): the solver's memory rows and the evaluation agree."""
    profile, opts = problem
    opts = opts.with_(precision="bf16-mixed")
    try:
        oracle = solve_brute(profile, opts)
    except ValueError:
        return
    try:
        found = solve(profile, opts)
    except InfeasibleError:
        assert oracle is None
        return
    assert oracle is not None and found.status == "optimal"
    assert math.isclose(found.objective, oracle.objective, rel_tol=1e-9)


def test_solver_matches_brute_force_with_a_frozen_only_rank_on_two_sites():
    """p = 2 x d = 2 placed across two sites, the front units frozen: a rank holding only frozen units
    exchanges nothing and pays no rings' latency (but for ZeRO-3's gathers). The branch and bound and
    the integer program (its binary 'rank exchanges anything') find brute force's optimum."""
    from tests.solve.test_branch import frozen_front_on_two_sites

    profile, base = frozen_front_on_two_sites()
    for schedule, v, shard in (("1f1b", 1, "none"), ("zb-v", 2, "none"), ("interleaved", 2, "none"),
                               ("1f1b", 1, "parameters"), ("interleaved", 2, "parameters")):
        # ZeRO-3: the frozen front's forwards gather, its backwards neither run nor gather
        opts = base.with_(schedule=schedule, virtual_stages=v, shard=shard)
        both_solvers_match_brute_force(profile, opts)


def test_solver_matches_brute_force_with_zero3_rings_per_collective_on_two_sites():
    """ZeRO-3 placed across two sites: each gather and reduce-scatter waits a ring's latency (units
    with 1, 2 or 3 collectives per micro-batch: a frozen unit without, a frozen unit with a gradient
    crossing its input, a trained unit). The branch and bound and the integer program find brute
    force's optimum."""
    from tests.solve.test_branch import frozen_front_on_two_sites

    profile, base = frozen_front_on_two_sites(L=6, frozen=4, gradient_from=2)
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        opts = base.with_(schedule=schedule, virtual_stages=v, shard="parameters")
        both_solvers_match_brute_force(profile, opts)


def test_the_integer_program_values_every_path_of_a_frozen_only_rank_as_the_model():
    """Each split fixed, with every split's longest path as a row: the program's step is the split's
    own (each path is at most it), a frozen-only rank's path through its exchange included."""
    import itertools

    from planner.cost.model import compute_profile
    from planner.solve.ilp import Program
    from tests.solve.test_branch import frozen_front_on_two_sites

    front, _ = frozen_front_on_two_sites()
    crossed, base = frozen_front_on_two_sites(gradient_from=2)  # ZeRO-3: 1, 2 and 3 collectives per unit
    for schedule, v, shard, profile in (("1f1b", 1, "none", front), ("interleaved", 2, "none", front),
                                        ("1f1b", 1, "parameters", front), ("1f1b", 1, "parameters", crossed)):
        opts = base.with_(schedule=schedule, virtual_stages=v, shard=shard)
        profile = compute_profile(profile, opts)
        L, S = profile.num_units, opts.num_stages
        splits = list(itertools.combinations(range(1, L), S - 1))
        costs = {cuts: evaluate(profile, list(cuts), 1, opts) for cuts in splits}
        for cuts, cost in costs.items():
            stage = [sum(1 for k in cuts if k <= l) for l in range(L)]
            program = Program(profile, 1, opts, stage, stage)
            for other in costs.values():
                program.add_form(other.critical_path, 1e9)
            assert program.solve(None, None, "highs").value_s == pytest.approx(cost.iteration_s, rel=1e-9), cuts


@pytest.mark.parametrize("schedule,ranks,cuts", [("zb-h1", 2, [1]), ("zb-v", 1, [2])])
def test_zero_bubble_recompute_auto_finds_the_plan_at_its_own_cap(schedule, ranks, cuts):
    # the fastest plan at its own memory recomputes the last unit, which saves no more than its inputs
    # (s_l <= in_l) but frees its weight part's held bytes under zero bubble: the program had no
    # choice for it and called the cap infeasible (found by a fuzz against brute force)
    import itertools
    import os

    from planner.profile.profile import load_profile

    profile = load_profile(os.path.join(os.path.dirname(__file__), "..", "data", "zero_bubble_recompute_profile.json"))
    opts = CostOptions(pipeline_ranks=ranks, global_batch=24, schedule=schedule,
                       virtual_stages=2 if schedule == "zb-v" else 1, recompute="auto", optimizer="adamw")
    need = max(evaluate(profile, cuts, 1, opts, [0, 2]).device_memory)
    for cap in (need, need + 65536):
        capped = opts.with_(memory_cap=cap)
        plans = [evaluate(profile, split, b, capped, list(redo)) for split in ([1], [2]) for b in (1, 2)
                 for r in range(4) for redo in itertools.combinations(range(3), r)]
        best = min(c.iteration_s for c in plans if c.feasible)
        found = solve(profile, capped, time_limit=20)
        assert found.status == "optimal" and math.isclose(found.objective, best, rel_tol=1e-9), cap
        assert found.recompute == [0, 2]
