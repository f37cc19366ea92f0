"""Replicated stages (a heavy stage on several devices, micro-batches round-robin): instruction
lists checked as data, the simulator, and real runs against single-process training."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.pipeline import schedule as sched
from planner.pipeline.check import check_schedule
from planner.pipeline.simulate import simulate
from planner.pipeline.topology import TopologyError, instruction_lists, topology_of
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, report_of, reshape_plan


def _topology(replicas, m, schedule="1f1b", d=1, devices=None, virtual_stages=1):
    """The topology of a plan whose stage g has replicas[g] devices (the plan's other fields default)."""
    return topology_of(devices or [None] * len(replicas), replicas, schedule, m, virtual_stages, data_parallel=d)


def _lists(replicas, m, schedule="1f1b"):
    return instruction_lists(_topology(replicas, m, schedule), schedule, m)


def _step_s(replicas, m, schedule, costs):
    """The simulated step of the lists; costs[g] = (forward, backward, transfer of g's outputs,
    transfer of the gradients of g's inputs) per micro-batch."""
    value = {}
    for g, (forward, backward, act, grad) in costs.items():
        value.update({("forward", g): forward, ("backward", g): backward, ("act", g): act})
        if g > 0:
            value[("grad", g - 1)] = grad
    timeline, _ = simulate(_lists(replicas, m, schedule), value, _topology(replicas, m, schedule).rank_running)
    return timeline.step_s


@settings(max_examples=200, deadline=None)
@given(replicas=st.lists(st.integers(1, 3), min_size=1, max_size=4), extra=st.integers(0, 6),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_replicated_lists_are_complete_placed_and_deadlock_free(replicas, extra, schedule):
    m = max(replicas) + extra
    topology = _topology(replicas, m, schedule)
    lists = _lists(replicas, m, schedule)
    assert len(lists) == sum(replicas) == topology.pipeline_ranks
    check_schedule(lists, m, placement=topology.rank_running)
    held = {}
    for position, actions in enumerate(lists):
        (g,) = topology.stages_of(position)
        mine = topology.micro_batches_of(position, g, m)
        assert sorted(a.micro_batch for a in actions if a.kind == sched.ActionKind.FORWARD) == mine
        held[g] = max(held.get(g, 0), sched.max_in_flight(actions))
    warmups = sched.one_f_one_b_warmups(replicas, m)
    for g, r in enumerate(replicas):  # what the plan's memory model charges a replica device
        window = m if schedule == "gpipe" else min(warmups[g] + 1, m)
        assert held[g] == math.ceil(window / r)
    if all(r == 1 for r in replicas):
        assert warmups == [min(len(replicas) - g - 1, m) for g in range(len(replicas))]


def test_without_replicas_the_lists_are_the_unreplicated_ones():
    for schedule in ("gpipe", "1f1b"):
        assert _lists([1, 1, 1], 5, schedule) == sched.build_schedule(schedule, 3, 5)


def test_1f1b_with_replicas_is_never_slower_than_gpipe():
    # a wide stage between two narrow ones (VGG-like): each replica must find its next forward
    # ready, or 1F1B serialises the wide stage (it did, 2x slower, with w_g = sum_{h>=g} r_h - 1);
    # and a narrow stage must not wait in a batch for a replica that asks for its output a round
    # later (15 of these 60 were slower, by up to 1.18x, before planner.pipeline.pulled)
    import random

    rng = random.Random(0)
    for _ in range(60):
        replicas = [rng.choice([1, 1, 2, 3, 6]) for _ in range(rng.randint(2, 4))]
        m = rng.choice([8, 12, 16])
        if max(replicas) > m:
            continue
        costs = {g: (r * rng.uniform(0.2, 0.4), r * rng.uniform(0.4, 0.8), 0.05, 0.05)
                 for g, r in enumerate(replicas)}
        one_f_one_b = _step_s(replicas, m, "1f1b", costs)
        gpipe = _step_s(replicas, m, "gpipe", costs)
        assert one_f_one_b <= gpipe * (1 + 1e-9), (replicas, m)


def test_replicated_placement_weighs_the_busy_stage():
    # a wide stage's ranks are busy three times as long per micro-batch: placing messages as if they
    # were not made stage 0 wait for each rank's whole backward (66 against 48 now; GPipe 55 -> 43)
    costs = {0: (1.0, 2.0, 0.0, 0.0), 1: (3.0, 6.0, 0.0, 0.0)}
    assert _step_s([1, 3], 12, "1f1b", costs) <= 48 + 1e-9
    assert _step_s([1, 3], 12, "gpipe", costs) <= 43 + 1e-9


def test_misplaced_action_is_caught():
    topology = _topology([1, 2], 4)
    lists = _lists([1, 2], 4)
    with pytest.raises(ValueError, match="places"):
        check_schedule([lists[0], lists[2], lists[1]], 4, placement=topology.rank_running)
    with pytest.raises(ValueError, match="micro-batches"):  # a replica dropped: its micro-batches never run
        check_schedule(lists[:2], 4)


def test_replicating_the_heavy_stage_shortens_the_step():
    # stage 1 costs three times stage 0: three replicas of it balance the pipeline
    costs = {0: (1.0, 2.0, 0.0, 0.0), 1: (3.0, 6.0, 0.0, 0.0)}
    m = 12
    plain = _step_s([1, 1], m, "1f1b", costs)
    replicated = _step_s([1, 3], m, "1f1b", costs)
    assert plain == pytest.approx(3 + 9 + (m - 1) * 9)  # sum T + (m - 1) max T
    # above stage 0's own work (3 m), and shorter than without replicas
    assert 3 * m < replicated < plain


def test_replicated_step_within_the_closed_form():
    costs = {0: (1.0, 2.0, 0.0, 0.0), 1: (3.0, 6.0, 0.0, 0.0)}
    # the closed form sum T + max_g (ceil(m / r_g) - 1) T_g = 12 + max(11 * 3, 3 * 9); 47 before
    # planner.pipeline.pulled (66 before the replay weighed replicated stages)
    # -- within it, and no more than GPipe's 43, which no list beats: the three replicas start their 36
    # units of work at 1, 2 and 3 at the earliest, and stage 0 then runs the three last backwards (2 each)
    # one after the other: max(37 + 6, 38 + 4, 39 + 2) = 43
    assert _step_s([1, 3], 12, "1f1b", costs) == pytest.approx(43)


def test_topology_of_replicated_plans():
    t = _topology([1, 3, 2], 6, d=2)
    assert (t.pipeline_ranks, t.world_size) == (6, 12)
    assert t.stage_rank == (0, 1, 4) and t.ranks_of(1) == [1, 2, 3]
    assert [t.rank_running(1, i) for i in range(6)] == [1, 2, 3, 1, 2, 3]
    assert t.stages_of(3) == [1] and t.lane_of(3) == 2 and t.lane_of(4) == 0
    assert t.data_parallel_group(2) == [1, 2, 3, 7, 8, 9]
    assert t.primary_ranks() == [0, 1, 4]
    with pytest.raises(TopologyError, match="virtual_stages"):
        _topology([1, 2], 4, virtual_stages=2)
    with pytest.raises(TopologyError, match="gpipe or 1f1b"):
        _topology([1, 2], 4, schedule="interleaved")
    with pytest.raises(TopologyError, match="nothing to do"):
        _topology([1, 3], 2)
    with pytest.raises(TopologyError, match="consecutive"):
        _topology([2, 1], 4, devices=[None, 1])


def _gpt_plan(cuts, b=1, g=8, schedule="1f1b"):
    return plan_with(profile_of("builtin:gpt", {"layers": 4}), cuts, b, g, schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_replicated_last_stage_is_exact(tmp_path, schedule):
    # 3 ranks: stage 0 on rank 0, the heavy head stage on ranks 1 and 2 (odd micro-batches on 2)
    plan = reshape_plan(_gpt_plan([3], schedule=schedule), replicas=[1, 2])
    state = execute(plan, tmp_path)
    losses = []
    assert max_abs_diff(state, reference_state(plan, losses=losses)) <= 1e-5
    report = report_of(tmp_path)
    assert [s["loss"] for s in report["steps"]] == pytest.approx(losses, rel=1e-5)
    assert [(s["chunks"], s["lane"]) for s in report["stages"]] == [([0], 0), ([1], 0), ([1], 1)]
    m = plan.num_micro_batches
    forward = plan.stages[1].forward_s
    assert [s["predicted"]["forward_s"] for s in report["stages"][1:]] == pytest.approx([m / 2 * forward] * 2)


def test_replicated_stage_with_data_parallel_and_adamw(tmp_path):
    # d = 2 copies of a 2-stage pipeline whose first stage has 2 replicas: 6 ranks, one all-reduce
    # over the 4 holders of stage 0
    plan = reshape_plan(_gpt_plan([4], b=1, g=4), replicas=[2, 1], data_parallel=2)
    assert plan.global_batch == 8
    state = execute(plan, tmp_path, steps=2, lr=1e-3, extra=["--optimizer", "adamw"])
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1e-3, optimizer="adamw")) <= 1e-5


def test_replicated_stage_with_tied_weights(tmp_path):
    # the embedding (stage 0) and the head (stage 1, two replicas) share one weight
    plan = reshape_plan(plan_with(profile_of("tests.models:tied_lm"), [2], 2, 8, "1f1b"), replicas=[1, 2])
    state = execute(plan, tmp_path)
    assert max_abs_diff(state, reference_state(plan)) <= 1e-5


def test_replicas_are_not_ties():
    # a replicated stage's parameters are summed with its replica group in one flat all-reduce,
    # not one collective per parameter; a real tie spans every holder of either use
    from runtime.stage import build_rank

    plan = reshape_plan(_gpt_plan([3]), replicas=[1, 2])
    assert build_rank(plan, plan.topology(), 1).tied_groups == []
    tied = reshape_plan(plan_with(profile_of("tests.models:tied_lm"), [2], 2, 8, "1f1b"), replicas=[1, 2])
    rank = build_rank(tied, tied.topology(), 2)
    assert [ranks for _, ranks in rank.tied_groups] == [(0, 1, 2)] and len(rank.tied) == 1


@pytest.mark.parametrize("entry", ["tests.capture_models:ema_chain", "tests.capture_models:spectral_chain"])
def test_a_stage_writing_state_in_its_forward_is_never_replicated(entry):
    # an EMA and a step counter in buffers (no norm layer), spectral norm's power-iteration vectors: each
    # replica wrote its own copy from its own micro-batches (replicas [1, 2]: a counter at 6 where one process
    # counts 12, weights 1e-3 off). The profile marks the unit (the solver never replicates it), and the
    # runtime refuses a plan that does, naming it
    from runtime.stage import PlanMismatchError, build_rank

    profile = profile_of(entry, sizes=(2,))
    marked = [u.name for u in profile.units if u.running_stats]
    assert marked == (["layers.2"] if "ema" in entry else ["layers.0", "layers.1", "layers.2", "layers.3"])
    plan = reshape_plan(plan_with(profile, [2], 2, 8, "1f1b"), replicas=[1, 2])
    with pytest.raises(PlanMismatchError, match=r"stage 1's unit\(s\) 'layers.2'.* write state in their forward"):
        build_rank(plan, plan.topology(), 1)
    if "ema" in entry:  # the stage before it writes none: replicated, it trains as one process
        plan = reshape_plan(plan_with(profile, [2], 2, 8, "1f1b"), replicas=[2, 1])
        build_rank(plan, plan.topology(), 0)
