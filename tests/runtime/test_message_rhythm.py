"""runtime.message_rhythm in one process, its transport stubbed: the lists it runs are the two-stage 1F1B lists
rhythm_message_cost inverts, walked batch by batch as the engine groups them, with the stand-in compute between
and what each send packs left by the stand-in; its step count beside planner.profile.rhythm's constants. (The
two processes exchanging: tests/profile/test_measure.py's measure_link.)"""
import pytest

from planner.pipeline.actions import COMM_KINDS, ActionKind
from planner.pipeline.schedule import build_schedule
from planner.profile import rhythm
from runtime import message_rhythm

M = 4


@pytest.fixture(scope="module")
def engines():
    return [message_rhythm.message_engine(rank, None, M) for rank in (0, 1)]


def _grouped(actions):
    """Independently of runtime.program: each compute alone, each batch id's run of messages together."""
    groups = []
    for a in actions:
        if a.kind in COMM_KINDS and groups and groups[-1][-1].kind in COMM_KINDS and groups[-1][-1].batch == a.batch:
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


def test_it_runs_the_lists_the_message_cost_inverts(engines):
    lists = build_schedule("1f1b", 2, M)  # rhythm_message_cost's lists
    for rank, engine in enumerate(engines):
        assert [str(a) for a in engine.actions] == [str(a) for a in lists[rank]]
        assert [a.batch for a in engine.actions] == [a.batch for a in lists[rank]]
        assert [[engine.actions[k] for k in group] for group in engine.program] == _grouped(lists[rank])
        runner = engine.runners[rank]
        assert runner.kept_outputs == set() and runner.kept_inputs == set()  # as after a run's first forward
    # the cut carries one (1, 8) activation needing a gradient (MESSAGE_MODEL)
    sender = engines[0].runners[0]
    assert [tuple(shape) for shape, _ in sender.act_out.tensors] == [(1, 8)]


def test_the_steps_walk_every_batch_with_the_stand_in_compute_between(monkeypatch):
    posts, lists = {}, {}  # per rank: the batches it posted, its engine's list

    def stubbed(rank, local, micro_batches):  # the real engine, its posts recorded instead of made
        engine = real(rank, local, micro_batches)
        posted = posts.setdefault(rank, [])

        def run_batch(step, actions):
            for a in actions:  # a send packs what the stand-in left (rank 0's outputs, rank 1's input gradients)
                if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                    operation, _ = engine.messages[a.kind](step, a)
                    assert operation.send and operation.tensor.numel() > 0
            posted.append([str(a) for a in actions])

        engine._run_batch = run_batch
        lists[rank] = engine.actions
        return engine

    computed = []

    class Counted(rhythm.StandInCompute):
        def __call__(self, seconds):
            computed.append(seconds)

    real = message_rhythm.message_engine
    monkeypatch.setattr(message_rhythm, "message_engine", stubbed)
    monkeypatch.setattr(message_rhythm, "StandInCompute", Counted)
    steps = rhythm.rhythm_step_count(1e-3, 2e-3, M)
    for rank in (0, 1):
        computed.clear()
        times = message_rhythm.engine_rhythm_steps(rank, None, 1e-3, 2e-3, micro_batches=M)
        assert len(times) == (steps - rhythm.WARMUP_STEPS if rank == 0 else 0)
        assert all(t >= 0 for t in times)
        batches = [[str(a) for a in group] for group in _grouped(lists[rank]) if group[0].kind in COMM_KINDS]
        assert posts[rank] == batches * steps
        compute = [1e-3 if a.kind is ActionKind.FORWARD else 2e-3 for a in lists[rank]
                   if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)]
        assert computed == compute * steps and len(compute) == 2 * M


def test_the_step_count_keeps_within_the_budget():
    warm, least = rhythm.WARMUP_STEPS, rhythm.MIN_STEPS
    assert rhythm.rhythm_step_count(0.0, 0.0) == warm + 50  # at most 50 timed
    assert rhythm.rhythm_step_count(rhythm.MAX_COMPUTE_S, rhythm.MAX_COMPUTE_S) == warm + least  # at least MIN_STEPS
    for forward, backward in [(1e-3, 2e-3), (2e-3, 4e-3), (5e-4, 5e-4)]:
        timed = rhythm.rhythm_step_count(forward, backward) - warm
        cycle = (rhythm.MICRO_BATCHES + 1) * (forward + backward) + 1e-3
        assert least <= timed <= 50 and (timed == least or timed * cycle <= rhythm.BUDGET_S)
    # the engine's lists hold the micro-batches rhythm_latency's formula needs
    assert rhythm.MICRO_BATCHES >= 4
    with pytest.raises(ValueError, match="four micro-batches"):
        rhythm.rhythm_message_cost(1.0, 1e-3, 1e-3, 0.0, 3)
