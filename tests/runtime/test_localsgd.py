"""Local SGD (issue 22): 2 replicas x 2 pipeline stages with a weight tied across the stages, each
replica training alone and the two averaging their models every H = 2 steps, equal (1e-5) to d model
copies trained and averaged in one process on the same micro-batches (tests.support.localsgd), both
replicas, across a resume."""
import dataclasses
import os

import torch

from planner.plan.file import save_plan
from runtime.cli import main as runtime_main
from tests.support.localsgd import local_sgd_reference, replica_state
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, reshape_plan

MOMENTUM = ["--momentum", "0.9"]


def _plan(entry, args, cuts):
    plan = reshape_plan(plan_with(profile_of(entry, args), cuts, 2, 4, "1f1b"), data_parallel=2)  # 4 ranks, G = 8
    return dataclasses.replace(plan, sync_every=2)


def test_replicas_average_every_h_steps_like_one_process_across_a_resume(tmp_path):
    # the embedding (rank 0) and the head (rank 1) share a weight: its gradient is summed over the two
    # ranks of one replica, never across replicas; SGD's momentum stays each replica's own
    plan = _plan("tests.models:tied_lm", {}, [2])
    checkpoints = str(tmp_path / "ckpt")
    # 3 steps: averaged after step 2, then one step each alone; every rank checkpoints its replica
    state = execute(plan, tmp_path / "run", steps=3, extra=[*MOMENTUM, "--checkpoint-dir", checkpoints,
                                                            "--checkpoint-every", "3"])
    reference = local_sgd_reference(plan, steps=3, sync_every=2, training={"momentum": 0.9})
    assert max_abs_diff(state, reference[0]) <= 1e-5
    assert max_abs_diff(replica_state(plan, checkpoints, 3, 1), reference[1]) <= 1e-5
    assert torch.equal(state["emb.weight"], state["head.weight"])
    assert max_abs_diff(reference[0], reference[1]) > 1e-4  # the last step left the replicas apart
    # not the per-step gradient all-reduce's training
    assert max_abs_diff(state, reference_state(plan, steps=3, training={"momentum": 0.9})) > 1e-4
    with open(tmp_path / "run" / "execute.out") as f:
        assert "average their models every 2 steps" in f.read()
    # resumed for a 4th step: the run's step counter, so the replicas average after it
    resumed = execute(plan, tmp_path / "resumed", steps=4, extra=[*MOMENTUM, "--checkpoint-dir", checkpoints,
                                                                  "--resume"])
    after = local_sgd_reference(plan, steps=4, sync_every=2, training={"momentum": 0.9})
    assert max_abs_diff(after[0], after[1]) == 0.0
    assert max_abs_diff(resumed, after[0]) <= 1e-5


def test_what_a_local_sgd_plan_cannot_run_with_is_refused_in_one_line(tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    save_plan(_plan("tests.models:tied_lm", {}, [2]), path)
    for extra, words in [(["--clip-grad-norm", "1"], "--clip-grad-norm with a local-SGD plan"),
                         (["--engine", "torch"], "--engine torch cannot run a plan with local SGD")]:
        code = runtime_main(["execute", path, "--steps", "1", *extra])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (extra, err)
    assert not os.path.exists(tmp_path / "state.pt")


def test_the_averaged_tensors_are_the_trained_parameters_and_floating_point_buffers():
    from types import SimpleNamespace

    from runtime.localsgd import ModelAverager
    from runtime.stage import RankModel

    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    module[0].bias.requires_grad_(False)  # frozen: equal in every replica
    averager = ModelAverager(RankModel(spec=None, stages=[SimpleNamespace(module=module)], tied={}, tied_groups=[]),
                             group=None, replicas=2, every=3)
    averaged = {id(t) for tensors in averager.groups.values() for t in tensors}
    bn = module[1]
    assert averaged == {id(module[0].weight), id(bn.weight), id(bn.bias), id(bn.running_mean), id(bn.running_var)}
    assert [averager.due(step) for step in range(6)] == [False, False, True, False, False, True]
