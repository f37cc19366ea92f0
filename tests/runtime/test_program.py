"""How the engine groups a list into batches, and `runtime show --json`."""
import json

from planner.pipeline.actions import COMM_KINDS, Action, ActionKind
from planner.plan.file import save_plan
from runtime.program import actions_json, batch_ids, batches
from tests.support.runs import plan_with, profile_of, reshape_plan, run_cli


def _a(text, batch=-1):
    action = Action.parse(text)
    return Action(action.kind, action.micro_batch, action.stage, batch=batch)


def test_batches_follow_the_ids_and_adjacency():
    step = Action(ActionKind.OPTIMIZER_STEP)
    listed = [_a("0F0"), _a("0SEND_F0", 0), _a("0RECV_B0", 0), _a("0SEND_F1", 1), _a("0B0"), step]
    assert batches(listed) == [[0], [1, 2], [3], [4], [5]]
    assert batch_ids(listed) == [None, 0, 0, 1, None, None]
    # without ids: a maximal run of adjacent communication actions, numbered in list order
    bare = [_a("1RECV_F0"), _a("1F0"), _a("1SEND_F0"), _a("1RECV_F1"), _a("1F1"), step]
    assert batches(bare) == [[0], [1], [2, 3], [4], [5]]
    assert batch_ids(bare) == [0, None, 1, 1, None, None]


def test_show_json_is_every_rank_list_with_batches(tmp_path):
    plan = reshape_plan(plan_with(profile_of("builtin:gpt", {"layers": 6}), [2, 5, 7], 2, 8, "1f1b"),
                        virtual_stages=2, schedule="interleaved")
    path = str(tmp_path / "plan.json")
    save_plan(plan, path)
    shown = run_cli(["runtime.cli", "show", path, "--json"])
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    lists = plan.instruction_lists()
    assert [r["rank"] for r in data["ranks"]] == list(range(len(lists)))
    for entry, actions in zip(data["ranks"], lists):
        assert [(a["kind"], a["micro_batch"], a["stage"]) for a in entry["actions"]] == \
            [(a.kind.value, a.micro_batch, a.stage) for a in actions]
        for shown_action, action in zip(entry["actions"], actions):
            assert ("batch" in shown_action) == (action.kind in COMM_KINDS)
            if action.kind in COMM_KINDS:
                assert shown_action["batch"] == action.batch
    assert data == actions_json(lists)
    # stages on one rank hand over in memory: no messages at all
    alone = reshape_plan(plan_with(profile_of("builtin:gpt", {"layers": 6}), [2, 5], 2, 8, "1f1b"),
                         virtual_stages=3, schedule="interleaved")
    (rank,) = actions_json(alone.instruction_lists())["ranks"]
    assert {a["kind"] for a in rank["actions"]} == {"forward", "backward", "optimizer_step"}
