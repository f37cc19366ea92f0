"""Instruction lists are pure data: check them without processes."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.pipeline import schedule as sched
from planner.pipeline.check import check_schedule
from planner.pipeline.simulate import simulate
from planner.pipeline.topology import TopologyError, topology_of

CONFIGS = [(name, p, v, m) for name in ("gpipe", "1f1b", "interleaved", "bfs") for p in (1, 2, 3, 4)
           for v in ((1,) if name in ("gpipe", "1f1b") else (1, 2, 3)) for m in range(1, 10)
           if not (name == "interleaved" and m % p)]


@pytest.mark.parametrize("name,p,v,m", CONFIGS)
def test_every_schedule_is_complete_and_deadlock_free(name, p, v, m):
    lists = sched.build_schedule(name, p * v, m, v)
    assert len(lists) == p
    check_schedule(lists, m)


@given(kind=st.sampled_from(list(sched.ActionKind)), micro_batch=st.integers(0, 10 ** 6), stage=st.integers(0, 999))
def test_action_text_round_trips(kind, micro_batch, stage):
    action = sched.Action(kind) if kind is sched.ActionKind.OPTIMIZER_STEP else sched.Action(kind, micro_batch, stage)
    assert sched.Action.parse(str(action)) == action


def test_action_text_form_and_every_built_action_parses_back():
    K = sched.ActionKind
    assert [str(sched.Action(k, 5, 2)) for k in (K.FORWARD, K.BACKWARD, K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD,
                                                   K.RECV_GRAD)] == ["2F5", "2B5", "2SEND_F5", "2RECV_F5", "2SEND_B5",
                                                                     "2RECV_B5"]
    assert str(sched.Action(K.OPTIMIZER_STEP)) == "STEP" and sched.Action.parse("12F3") == sched.Action(K.FORWARD, 3, 12)
    for bad in ("F5", "2X5", "2F", "", "step", "2F5 "):
        with pytest.raises(ValueError, match="not an action"):
            sched.Action.parse(bad)
    built = [sched.build_schedule(name, p * v, m, v) for name, p, v, m in CONFIGS[::7]]
    built.append(sched.build_schedule("1f1b", 3, 6, 1, stage_replicas=[1, 2, 1]))
    for lists in built:
        for actions in lists:
            assert [sched.Action.parse(str(a)) for a in actions] == actions


def test_in_flight_micro_batches():
    # 1F1B: stage s holds min(S - s, m); GPipe: m; bfs: every micro-batch of every stage.
    for s, actions in enumerate(sched.build_schedule("1f1b", 4, 6)):
        assert sched.max_in_flight(actions) == min(4 - s, 6)
    assert all(sched.max_in_flight(a) == 6 for a in sched.build_schedule("gpipe", 4, 6))
    assert all(sched.max_in_flight(a) == 12 for a in sched.build_schedule("bfs", 4, 6, 2))
    # interleaved holds fewer than bfs but more than plain 1F1B's first stage
    interleaved = sched.build_schedule("interleaved", 4, 4, 2)
    assert sched.max_in_flight(interleaved[0]) == 2 * (2 - 0 - 1) + (2 - 1) * 2 + 1


def test_deadlock_is_detected():
    lists = sched.build_schedule("1f1b", 2, 2)
    # rank 1 waiting for a gradient nobody sends: swap rank 0's send of micro-batch 1 after its backward
    bad = [a for a in lists[0] if not (a.kind == sched.ActionKind.SEND_ACT and a.micro_batch == 1)]
    bad.insert(len(bad) - 1, sched.Action(sched.ActionKind.SEND_ACT, 1, 0))
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule([bad, lists[1]], 2)
    with pytest.raises(ValueError, match="micro-batches"):
        check_schedule([lists[0][:-3] + [lists[0][-1]], lists[1]], 2)


def test_bad_schedule_requests_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of the pipeline depth"):
        sched.build_schedule("interleaved", 4, 3, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        sched.build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="interleaved"):
        sched.build_schedule("1f1b", 4, 4, 2)


def _step(name, stages, m, f, b, v=1):
    """Simulated step of the built lists: every stage's forward f and backward b, messages free."""
    p = stages // v
    value = {term: t for g in range(stages) for term, t in ((("forward", g), f), (("backward", g), b))}
    timeline, _ = simulate(sched.build_schedule(name, stages, m, v), value, lambda g, i: g % p)
    return timeline.step_s


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 8), (3, 5)])
def test_simulation_matches_closed_form_on_equal_stages(name, p, m):
    # equal stages, free transfers: (m + p - 1)(f + b) = sum_s T_s + (m - 1) max_s T_s
    f, b = 1.0, 2.0
    assert _step(name, p, m, f, b) == pytest.approx(p * (f + b) + (m - 1) * (f + b))


def test_interleaving_shrinks_the_bubble():
    # 8 equal stages on 4 ranks: interleaving (v = 2) beats 1F1B on 4 stages of twice the work
    m = 8
    one = _step("1f1b", 4, m, 2.0, 4.0)
    two = _step("interleaved", 8, m, 1.0, 2.0, v=2)
    assert two < one
    ideal = m * 6.0
    assert (two - ideal) / ideal == pytest.approx((4 - 1) / (2 * m), rel=1e-9)


def test_topology_from_plan():
    t = topology_of([None] * 6, [1] * 6, "interleaved", 6, virtual_stages=2, data_parallel=2)
    assert (t.pipeline_ranks, t.world_size) == (3, 6)
    assert t.stages_of(1) == [1, 4]
    assert t.data_parallel_group(2) == [2, 5]
    with pytest.raises(TopologyError):
        topology_of([None] * 6, [1] * 6, "interleaved", 6, virtual_stages=4)
