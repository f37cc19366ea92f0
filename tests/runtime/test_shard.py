"""Sharded optimizer state (ZeRO-1) and gradients (ZeRO-2) across data-parallel replicas train exactly
like one process (issue 25): 2 replicas x 2 stages, parameters within 1e-5 (fp32)."""
import dataclasses
import os

import pytest
import torch

from runtime.shard import deal
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, reshape_plan


def _plan(shard, model="builtin:gpt", args=None):
    plan = reshape_plan(plan_with(profile_of(model, args if args is not None else {"layers": 4}), [3], 2, 4, "1f1b"),
                        data_parallel=2)  # 4 ranks, global batch 8
    return dataclasses.replace(plan, shard=shard)


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_replicas_train_like_one_process(tmp_path, shard):
    # AdamW (state to shard); lr 1e-4: its first steps move every parameter by ~lr whatever the
    # gradient's size, so summation-order noise in tiny gradients shows as ~0.01 lr, sharded or not;
    # betas and decay other than torch's defaults reach the sharded optimizers
    plan = _plan(shard)
    ckpt = str(tmp_path / "ckpt")
    state = execute(plan, tmp_path, lr=1e-4, extra=["--optimizer", "adamw", "--betas", "0.5,0.9", "--weight-decay",
                                                    "0.5", "--checkpoint-dir", ckpt, "--checkpoint-every", "3"])
    assert max_abs_diff(state, reference_state(plan, lr=1e-4, optimizer="adamw",
                                               training=dict(betas=(0.5, 0.9), weight_decay=0.5))) <= 1e-5
    # each replica of a stage keeps the AdamW state of its share of the parameters only
    topology = plan.topology()
    for position in range(topology.pipeline_ranks):
        ranks = topology.data_parallel_group(position)
        held = [_state_elements(os.path.join(ckpt, "step-000003", f"rank{r}.pt")) for r in ranks]
        params = sum(t.numel() for name, t in state.items()
                     if any(name.startswith(u) for u in plan.stages[position].units))
        assert all(0 < h < 2 * params for h in held) and sum(held) == 2 * params  # 2 moments


def _state_elements(path):
    saved = torch.load(path, weights_only=True)["optimizer"]["state"]
    return sum(t.numel() for entry in saved.values() for k, t in entry.items() if k in ("exp_avg", "exp_avg_sq"))


def test_gradient_sharding_with_tied_weights(tmp_path):
    plan = reshape_plan(plan_with(profile_of("tests.models:tied_lm"), [2], 2, 4, "1f1b"), data_parallel=2)
    plan = dataclasses.replace(plan, shard="gradients")
    state = execute(plan, tmp_path)
    assert max_abs_diff(state, reference_state(plan)) <= 1e-5
    assert torch.equal(state["emb.weight"], state["head.weight"])


def test_parameters_are_dealt_by_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 3, 3, 8, 1)]
    assert deal(params, 2) == [0, 1, 1, 1, 0]
    assert deal(params, 1) == [0] * 5


def _zero2_rank(rank, port, out):
    import torch.distributed as dist
    from runtime.shard import GradientShardedOptimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    opt = GradientShardedOptimizer(params, [], torch.optim.SGD, dict(lr=0.0), dist.group.WORLD)
    for micro_batch in range(2):  # each rank's own inputs: the owner must end with the sum of all four
        model(torch.full((1, 4), float(1 + rank + 2 * micro_batch))).sum().backward()
    out[rank] = {i: (None if p.grad is None else p.grad.clone()) for i, p in enumerate(params)}
    out[f"owners{rank}"] = list(opt.owners)
    dist.destroy_process_group()


def test_gradient_sharding_keeps_only_the_owned_gradients():
    import socket
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_zero2_rank, args=(port, out), nprocs=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for x in (1, 2, 3, 4):  # one process, all four micro-batches
        model(torch.full((1, 4), float(x))).sum().backward()
    owners = out["owners0"]
    for i, p in enumerate(model.parameters()):
        owner, other = owners[i], 1 - owners[i]
        assert out[other][i] is None  # dropped by the holder that does not own it
        assert torch.allclose(out[owner][i], p.grad, atol=1e-6)


def test_clipping_a_plan_that_shards_gradients_is_refused_before_any_rank_starts(tmp_path, capsys):
    # the rule lived in the ranks alone: each failed after building its model; now runtime execute
    # refuses it in one line (runtime.options.run_refusal, also asked by every rank)
    from planner.plan.file import save_plan
    from runtime.cli import main as runtime_main

    path = str(tmp_path / "plan.json")
    save_plan(_plan("gradients"), path)
    assert runtime_main(["execute", path, "--steps", "1", "--clip-grad-norm", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--clip-grad-norm with a plan sharding gradients" in err
    assert "Traceback" not in err and "rank" not in err
