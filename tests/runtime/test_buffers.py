"""Buffers (BatchNorm's running statistics and batch counts) end as in one process: with
recomputation (the forward runs again in backward) and, per replica, with data parallelism."""
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, reshape_plan
from tests.support.staged import run_in_process

RESNET_BN = ("builtin:resnet", {"inplace": True, "batchnorm": True})


def _buffers(state):
    return {k: v for k, v in state.items() if "running" in k or "num_batches" in k}


def test_recomputed_batchnorm_updates_its_statistics_once():
    profile = profile_of(*RESNET_BN, sizes=(2,))
    plan = reshape_plan(plan_with(profile, [3], 2, 8, "1f1b"),
                        recompute={0: ["stem", "layers.0", "layers.1"], 1: ["layers.2", "layers.3"]})
    state = run_in_process(plan, steps=2)
    reference = reference_state(plan, steps=2)
    assert _buffers(reference) and max_abs_diff(state, reference) <= 1e-5


def test_data_parallel_replicas_keep_their_own_statistics(tmp_path):
    """d = 2: each replica's running statistics follow its own micro-batches (as DDP without
    SyncBatchNorm); the saved state is replica 0's. Parameters are the whole batch's."""
    plan = reshape_plan(plan_with(profile_of(*RESNET_BN, sizes=(2,)), [], 2, 4, "1f1b"), data_parallel=2)
    state = execute(plan, tmp_path, steps=2)
    replica0 = reference_state(plan, steps=2, buffers_of_replica=0)
    assert max_abs_diff(state, replica0) <= 1e-5
    everyone = reference_state(plan, steps=2)  # all micro-batches update: not what a replica holds
    assert max_abs_diff(_buffers(state), _buffers(everyone)) > 1e-4


def test_the_profile_counts_the_buffers_local_sgd_averages():
    """Each unit's floating-point buffer bytes, recorded at capture: what runtime.localsgd averages
    besides the trainable parameters (the integer batch counts are not averaged, nor counted)."""
    from planner.model.entry import build_spec

    profile = profile_of(*RESNET_BN, sizes=(2,))
    module = build_spec(*RESNET_BN, 0).module
    floating = sum(b.numel() * b.element_size() for b in module.buffers() if b.is_floating_point())
    assert floating > 0 and sum(u.buffer_bytes for u in profile.units) == floating
