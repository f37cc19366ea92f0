"""The lists under NCCL's rules: a pair's messages matched in posting order, a send done only with its
receive, a batch posted together and waited for entirely (planner.pipeline.stepgraph)."""
import pytest

from planner.pipeline import schedule as sched
from planner.pipeline.check import check_schedule
from planner.pipeline.schedule import Action, ActionKind
from planner.pipeline.stepgraph import DeadlockError, StepGraph


def _unbatched(lists):
    """The lists with every communication action a batch of its own (each posted and waited alone)."""
    out, batch = [], 0
    for actions in lists:
        mine = []
        for a in actions:
            if a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD):
                mine.append(Action(a.kind, a.micro_batch, a.stage, batch=batch))
                batch += 1
            else:
                mine.append(a)
        out.append(mine)
    return out


def _old_1f1b(p, m):
    """1F1B as this runtime listed it before batches: receive, compute, send for every micro-batch."""
    lists = []
    for g in range(p):
        warmup = min(p - g - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", i) for i in range(m - warmup, m)]
        actions = []
        for kind, i in order:
            if kind == "F":
                actions += ([Action(ActionKind.RECV_ACT, i, g)] if g > 0 else []) + [Action(ActionKind.FORWARD, i, g)]
                actions += [Action(ActionKind.SEND_ACT, i, g)] if g < p - 1 else []
            else:
                actions += ([Action(ActionKind.RECV_GRAD, i, g)] if g < p - 1 else []) + [Action(ActionKind.BACKWARD, i, g)]
                actions += [Action(ActionKind.SEND_GRAD, i, g)] if g > 0 else []
        lists.append(actions + [Action(ActionKind.OPTIMIZER_STEP)])
    return lists


def test_the_checker_catches_the_unbatched_1f1b_deadlock():
    """Stage s posts send_act then recv_grad while s + 1 posts send_grad then recv_act: each waits for
    a receive the other posts after its own blocked send."""
    lists = _unbatched(_old_1f1b(4, 8))
    with pytest.raises(DeadlockError, match="deadlock"):
        check_schedule(lists, 8, placement=lambda g, i: g)


def test_a_pair_posting_messages_in_different_orders_is_refused():
    lists = sched.build_schedule("gpipe", 2, 2)
    receiver = list(lists[1])
    first = next(k for k, a in enumerate(receiver) if a.kind == ActionKind.RECV_ACT)
    second = next(k for k, a in enumerate(receiver) if a.kind == ActionKind.RECV_ACT and k > first)
    receiver[first], receiver[second] = receiver[second], receiver[first]
    with pytest.raises(ValueError, match="same order"):
        check_schedule([lists[0], receiver], 2, placement=lambda g, i: g)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("bfs", 2), ("interleaved", 3),
                                    ("bfs", 4)])
def test_every_schedule_passes_for_p_up_to_8(name, v):
    for p in range(1, 9):
        for m in (p, 2 * p, 2 * p + 1):
            if name == "interleaved" and m % p:
                continue
            lists = sched.build_schedule(name, p * v, m, v)
            check_schedule(lists, m, placement=lambda g, i: g % p)
            for actions in lists:  # a batch stands together in its list
                ids = [a.batch for a in actions if a.batch >= 0]
                assert all(ids.index(x) + ids.count(x) - 1 == len(ids) - 1 - ids[::-1].index(x) for x in set(ids))


def test_replicated_lists_pass():
    for replicas in ([1, 2], [2, 1, 3], [3, 3]):
        m = 2 * max(replicas) + 1
        for name in ("gpipe", "1f1b"):
            lists = sched.build_schedule(name, len(replicas), m, stage_replicas=replicas)
            offsets = [sum(replicas[:g]) for g in range(len(replicas))]
            check_schedule(lists, m, placement=lambda g, i: offsets[g] + i % replicas[g])


def test_stages_on_one_rank_hand_over_without_messages():
    lists = sched.build_schedule("interleaved", 2, 2, 2)  # p = 1: both stages on rank 0
    assert not [a for a in lists[0] if a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)]
    StepGraph(lists, lambda g, i: 0)
