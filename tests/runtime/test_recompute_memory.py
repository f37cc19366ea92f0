"""Recomputed units keep their checkpoint's arguments, each storage once: a sequence and a view of it (an unrolled
LSTM's x and its step x[:, t], a block's h and its class token h[:, 0]) are one storage inside a stage and two
where a stage receives them, and a view of part of a storage (a head reading the last block's class token) keeps
all of it (planner.cost.shared_storage.kept_inputs). The plan counted each view's message bytes everywhere: under
zero bubble with recomputation the first rank planned 10-19 % more than it held and a later one 8 % less (a
recomputed head's token view keeping the whole sequence). Held = planned to the byte, trained as one process."""
import pytest

from planner.cost.ranges import range_costs
from tests.support.runs import held_and_planned, profile_of


def test_a_unit_keeping_a_view_and_its_storage_keeps_the_storage_once():
    profile = profile_of("tests.capture_models:class_token", sizes=(2,))
    costs = range_costs(profile, 2)
    # blocks.1 reads h (256 B) and h[:, 0] (64 B): one storage inside a stage, two received
    assert costs.received_inputs[2] == 320 and costs.inputs[2] == 256
    # the head reads h[:, 0] alone: recomputed it keeps all of h (and what the loss saves)
    assert costs.inputs[4] - (costs.received_inputs[4] - 64) == 256


@pytest.mark.parametrize("entry,args,cuts,schedule,recompute", [
    ("tests.capture_models:class_token", {}, [2], "zb-h1", [0, 1, 2, 3, 4]),
    ("tests.capture_models:class_token", {}, [3], "zb-h1", [1, 2]),
    ("tests.capture_models:class_token", {}, [2], "1f1b", [0, 1, 2, 3, 4]),
    ("tests.capture_models:unrolled", {}, [3], "zb-h1", [1, 2]),
    ("tests.capture_models:unrolled", {"cell": "gru"}, [3], "zb-h1", [1, 2]),
])
def test_recomputed_views_of_one_storage_are_held_as_planned(tmp_path, entry, args, cuts, schedule, recompute):
    for held, planned in held_and_planned(tmp_path, entry, args, cuts, schedule, recompute):
        assert held == planned


@pytest.mark.parametrize("entry,args,cuts,recompute", [
    ("tests.capture_models:class_token", {"blocks": 4}, [3, 4, 5], [0, 1, 2, 3, 4, 5]),
    ("tests.capture_models:unrolled", {"steps": 4}, [3, 4, 5], [1, 2]),
])
def test_zb_v_ranks_with_recomputed_views_are_held_as_planned(tmp_path, entry, args, cuts, recompute):
    """Rank 0 runs the V's first and last stages; rank 1's two stages hand values over in memory, each view
    in a storage of its own as a message's (tests/runtime/test_view_memory.py)."""
    for held, planned in held_and_planned(tmp_path, entry, args, cuts, "zb-v", recompute):
        assert held == planned


def test_the_loss_keeps_all_of_a_copy_its_output_slices_and_nothing_more_of_a_received_value():
    """What the loss saves where the last unit is recomputed (planner.profile.saved.loss_saved_bytes): a slice
    of a copy the unit makes (h.flip(1)[:, 0]) keeps the whole copy (320 B, counted as the slice's 64 before);
    a slice of a value the unit receives (h[:, 0]) keeps what the recomputed unit keeps anyway (nothing more)."""
    loss_saved = {second: range_costs(profile_of("tests.models:sliced_output", {"second": second}, sizes=(2,)),
                                      2).loss_saved[-1] for second in ("flip", "view", "clone", "table")}
    head = 2 * 64  # the head's output and the target, which mse saves
    assert loss_saved == {"flip": head + 320, "view": head, "clone": head + 64, "table": head}


@pytest.mark.parametrize("second,cuts,schedule,recompute", [
    ("flip", [4], "gpipe", [4]),  # the last stage is the recomputed last unit alone
    ("flip", [2], "1f1b", [2, 3, 4]),
    ("view", [4], "gpipe", [4]),
    ("view", [2], "zb-h1", [3, 4]),
    ("flip", [1, 2, 3], "zb-v", [3, 4]),
    ("table", [4], "gpipe", [4]),  # the loss saves a slice of a parameter: nothing more held
])
def test_a_recomputed_last_unit_whose_output_slices_a_larger_value_is_held_as_planned(tmp_path, second, cuts,
                                                                                       schedule, recompute):
    for held, planned in held_and_planned(tmp_path, "tests.models:sliced_output", {"second": second}, cuts,
                                          schedule, recompute):
        assert held == planned
