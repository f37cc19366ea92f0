"""planner.pipeline.pulled: replicated stages' 1F1B messages, received when needed and sent just
before the receiver asks, and the memory an output held past a compute costs."""
import itertools

from planner.pipeline import schedule as sched
from planner.pipeline.actions import Action
from planner.pipeline.check import check_schedule
from planner.pipeline.messages import replay
from planner.pipeline.pulled import place_pulled_messages
from planner.pipeline.stepgraph import StepGraph, held_peaks


def _position(replicas):
    offsets = [sum(replicas[:g]) for g in range(len(replicas))]
    return lambda g, i: offsets[g] + i % replicas[g]


def test_every_batch_completes_as_the_replay_posts_it():
    # the rule's claim: under the replay's own durations (forward r_g, backward 2 r_g, messages free)
    # no rank waits for a batch, so the lists' simulated step is the replay's last end and they
    # cannot deadlock; were a batch to wait for a later peer, the step would exceed the replay's
    for replicas in itertools.chain.from_iterable(itertools.product((1, 2, 3, 4), repeat=n) for n in (1, 2, 3)):
        if max(replicas) == 1:
            continue
        for m in sorted({max(replicas), 2 * max(replicas) + 1, 12}):
            orders = sched.replicated("1f1b", replicas, m)
            weights = [float(r) for r in replicas]
            lists = place_pulled_messages(orders, len(replicas), _position(replicas), weights)
            check_schedule(lists, m, placement=_position(replicas))
            value = {}
            for g, w in enumerate(weights):
                value.update({("forward", g): w, ("backward", g): 2 * w})
            last = max(times[-1][1] for times in replay(orders, len(replicas), weights))
            assert StepGraph(lists, _position(replicas)).run(value).step_s == last, (replicas, m)


def _list(text):
    """Actions from text, a bracketed group standing for one batch: "1F0 [1SEND_F0 1RECV_F1] 1F1"."""
    actions, batch, inside = [], -1, False
    for token in text.replace("[", " [ ").replace("]", " ] ").split():
        if token in ("[", "]"):
            batch, inside = batch + (token == "["), token == "["
            continue
        a = Action.parse(token)
        actions.append(Action(a.kind, a.micro_batch, a.stage, batch=batch) if inside else a)
    return actions


def test_an_output_held_past_a_compute_is_counted_until_its_send_is_done():
    # 1F0's output sent only after 1F1 is held, beside two live micro-batches, while 1F1 runs and until
    # its batch is done; sent in a batch with a receive right after 1F0, it is gone before 1F1 starts
    deferred = _list("1F0 1F1 [1SEND_F0 1SEND_F1 1RECV_B0] 1B0 [1SEND_B0 1RECV_B1] 1B1 [1SEND_B1] STEP")
    at_once = _list("1F0 [1SEND_F0 1RECV_F1] 1F1 [1SEND_F1 1RECV_B0] 1B0 [1SEND_B0 1RECV_B1] 1B1 [1SEND_B1] STEP")
    assert held_peaks(deferred)[0] == {("live", 1): 2, ("sent_act", 1): 1, ("gradbox", 1): 1}
    assert not any(("sent_act", 1) in p for p in held_peaks(at_once))
