"""Each rank draws its own random stream (runtime.streams): a stage's dropout does not repeat the
masks of an earlier stage or of another replica, and what rank 0 alone draws is one process's."""
from runtime.streams import rank_seed
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, reshape_plan


def test_replicas_draw_masks_of_their_own(tmp_path):
    # every rank used to draw what rank 0 draws: both replicas the same masks for other samples
    plan = reshape_plan(plan_with(profile_of("tests.models:dropout_mlp", sizes=(2,)), [], 2, 8, "1f1b"),
                        data_parallel=2)
    state = execute(plan, tmp_path, steps=2)
    assert max_abs_diff(state, reference_state(plan, steps=2, replica_streams=True)) <= 1e-5
    assert max_abs_diff(state, reference_state(plan, steps=2)) > 1e-4  # not one process's order


def test_random_operations_on_rank_0_alone_draw_what_one_process_draws(tmp_path):
    args = {"dropping": 2}  # dropout in the first two of four layers, units 0-5: stage 0 below
    plan = plan_with(profile_of("tests.models:dropout_mlp", args, sizes=(2,)), [6], 2, 8, "1f1b")
    assert max_abs_diff(execute(plan, tmp_path, steps=2), reference_state(plan, steps=2)) <= 1e-5


def test_rank_seeds_differ_by_rank_and_seed():
    seeds = {rank_seed(seed, rank) for seed in range(4) for rank in range(1, 64)}
    assert len(seeds) == 4 * 63 and all(0 <= s < 2 ** 63 for s in seeds)
