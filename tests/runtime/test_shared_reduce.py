"""The data-parallel gradient all-reduce through shared memory (runtime/shared_reduce.py): members
of one process, driven from threads as ranks would drive them, and a run of four ranks."""
import fcntl
import json
import os
import random
import time
import uuid

import pytest
import torch

from runtime import shared_memory, shared_reduce, shm_files
from runtime.shared_memory import SharedMemoryTransport
from runtime.shared_reduce import SharedMemoryReducer, _Member
from tests.support.together import run_together

pytestmark = pytest.mark.skipif(not shared_memory.available(), reason="shared memory needs x86 and /dev/shm")


def _group(members, slot_bytes, timeout_s=20.0):
    """One reducer per member, as `reducer` makes them (each member's file, mapped by all)."""
    token = "t-reduce" + uuid.uuid4().hex[:8]
    paths = {m: shm_files.shm_path(token, f"reduce-{m}") for m in members}
    files = {m: _Member(paths[m], slot_bytes, create=True) for m in members}
    reducers = []
    for m in members:
        transport = SharedMemoryTransport(token, m, set(members) - {m}, timeout_s)
        mapped = {o: files[o] if o == m else _Member(paths[o], slot_bytes, create=False) for o in members}
        reducers.append(SharedMemoryReducer(transport, members, slot_bytes, mapped))
    for path in paths.values():
        os.unlink(path)
    return reducers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("members", [[0, 2, 5], [1, 3]])  # global ranks, not 0..n-1; two: each sums it all
def test_every_member_gets_the_sum_in_rank_order_through_many_chunks(dtype, members):
    reducers = _group(members, 4096)  # 4 KiB slots: a tensor goes in many chunks, both slots reused
    sizes = [1, 1024, 5000, 0, 3000]  # elements: within a chunk, exactly one, many, none
    rng = random.Random(0)
    inputs = [[torch.randn(n).to(dtype) for n in sizes] for _ in members]
    results = [[x.clone() for x in mine] for mine in inputs]

    def work(k):
        for x in results[k]:
            time.sleep(rng.random() * 1e-3)  # members arrive in every order
            reducers[k].all_reduce(x)

    run_together([lambda k=k: work(k) for k in range(len(members))])
    for j in range(len(sizes)):
        expected = inputs[0][j] + inputs[1][j]
        for k in range(2, len(members)):
            expected = expected + inputs[k][j]  # rank order
        for k in range(len(members)):
            assert torch.equal(results[k][j], expected)  # bitwise: the replicas stay equal
    assert [r.reductions for r in reducers] == [len(sizes)] * len(members)
    assert len({r.sequence for r in reducers}) == 1
    for r in reducers:
        r.close()
        r.transport.close()


def _gated(seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleDict({"inp": torch.nn.Linear(8, 8), "gate": torch.nn.Linear(8, 8)})


def _gated_loss(model, x):  # the gate's output reaches the loss only through a comparison: no gradient
    return (model["inp"](x) * (model["gate"](x) > 0)).square().sum()


def test_buckets_summed_by_a_reducer_run_no_hooks_and_still_drop_unreached_gradients():
    # the sum comes after the rank's list, so nothing starts early: no hook per parameter and backward;
    # each gradient's own version counter says whether a backward reached its parameter
    from runtime.groups import GradientBuckets

    reducers = _group([0, 1], 4096)
    models = [_gated(), _gated()]
    # one bucket: reached and unreached gradients share its memory (a view would share its version counter)
    buckets = [GradientBuckets(list(m.parameters()), None, bucket_bytes=1 << 20) for m in models]
    for b, r, m in zip(buckets, reducers, models):
        b.use_reducer(r)
        assert b.hooks == [] and not any(p._post_accumulate_grad_hooks for p in m.parameters())  # torch's own record
    inputs = [[torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * k + i)) for i in range(2)]
              for k in range(2)]

    def step(k):
        buckets[k].begin_step()
        for x in inputs[k]:  # two micro-batches
            _gated_loss(models[k], x).backward()
        buckets[k].finish()

    for _ in range(2):  # the second step begins from the buckets the first left
        run_together([lambda k=k: step(k) for k in range(2)])
    expected = _gated()
    for mine in inputs:
        for x in mine:
            _gated_loss(expected, x).backward()
    for model in models:
        for name, p in model.named_parameters():
            q = dict(expected.named_parameters())[name]
            assert (p.grad is None) == (q.grad is None) == name.startswith("gate")
            if q.grad is not None:
                assert torch.allclose(p.grad, q.grad, atol=1e-5)
    for r in reducers:
        r.close()
        r.transport.close()


def test_a_member_that_never_comes_is_named_after_the_timeout():
    first, second = _group([0, 1], 4096, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="rank 0 waited .* for rank 1 .*gradient all-reduce"):
        first.all_reduce(torch.ones(8))
    first.close(), second.close()


def test_a_tensor_that_is_not_one_contiguous_cpu_block_is_refused():
    first, second = _group([0, 1], 4096)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        first.all_reduce(torch.zeros(4, 4).t())
    first.close(), second.close()


def test_a_slot_is_a_page_multiple_and_at_most_slot_bytes():
    assert shared_reduce.slot_size(1) == 4096
    assert shared_reduce.slot_size(5000) == 8192
    assert shared_reduce.slot_size(1 << 30) == shared_reduce.SLOT_BYTES


def test_data_parallel_runs_sum_their_gradients_through_shared_memory_unless_told_gloo(tmp_path):
    from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, reshape_plan

    plan = reshape_plan(plan_with(profile_of("builtin:mlp"), [3], 2, 16, "1f1b"), data_parallel=2)  # 2 x 2 ranks
    losses = []
    reference = reference_state(plan, losses=losses)
    before = set(os.listdir(shm_files.SHM_DIR))
    for p2p in ("auto", "gloo"):
        state = execute(plan, tmp_path / p2p, extra=["--p2p", p2p])
        assert max_abs_diff(state, reference) <= 1e-5
        with open(tmp_path / p2p / "report.json") as f:
            report = json.load(f)
        # the step's loss is the mean over both replicas' micro-batches (summed by the same transport)
        assert [s["loss"] for s in report["steps"]] == pytest.approx(losses, rel=1e-6)  # fp32 losses
        # one bucket per rank, summed once in each of the 3 steps (the loss is not counted)
        assert [r["shared_memory_reductions"] for r in report["stages"]] == ([3] * 4 if p2p == "auto" else [0] * 4)
        transport = "shared memory" if p2p == "auto" else "torch.distributed"
        assert [r["gradient_all_reduce"] for r in report["stages"]] == [transport] * 4
        printed = (tmp_path / p2p / "execute.out").read_text()
        assert ("gradient all-reduce through shared memory on ranks 0-3" in printed) == (p2p == "auto")
    assert not [f for f in set(os.listdir(shm_files.SHM_DIR)) - before if f.startswith("pipeplanner-")]


def test_tied_weights_sum_through_shared_memory_unless_told_gloo(tmp_path):
    # a gloo all-reduce sleeps in the kernel: BERT's 1 MiB tied embedding took 1.2-2.2 ms a step
    # through it on a 2-core host, 0.34 ms through shared memory (the plan charges 0.16 ms)
    from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state

    plan = plan_with(profile_of("tests.models:tied_lm"), [2], 2, 8, "1f1b")  # emb on rank 0, head on rank 1
    reference = reference_state(plan)
    before = set(os.listdir(shm_files.SHM_DIR))
    for p2p in ("auto", "gloo"):
        state = execute(plan, tmp_path / p2p, extra=["--p2p", p2p])
        assert max_abs_diff(state, reference) <= 1e-5
        assert torch.equal(state["emb.weight"], state["head.weight"])
        with open(tmp_path / p2p / "report.json") as f:
            report = json.load(f)
        transport = "shared memory" if p2p == "auto" else "torch.distributed"
        assert [r["tie_all_reduce"] for r in report["stages"]] == [transport] * 2
    assert not [f for f in set(os.listdir(shm_files.SHM_DIR)) - before if f.startswith("pipeplanner-")]


def test_a_wait_that_ends_as_the_peer_is_checked_never_checks_this_ranks_own_lock():
    # every member became ready between the wait's ready() and its peer(): the laggard is then this
    # rank; a shared lock on its own liveness file would convert its lock and release it
    token = "t-own" + uuid.uuid4().hex[:8]
    path = shm_files.shm_path(token, "probe-0")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    transport = SharedMemoryTransport(token, 0, {1}, 5.0, {0: fd})
    other = os.open(path, os.O_RDWR)
    try:
        until = time.perf_counter() + 0.3  # past the spin: peer() is asked, and liveness checked
        transport.wait_until(lambda: time.perf_counter() > until, lambda: 0, "for nothing")
        with pytest.raises(BlockingIOError):  # still held by this rank
            fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:  # nothing left in /dev/shm, whatever the outcome
        os.close(other)
        os.unlink(path)
        transport.close()


def _two_members_agree(rank, init, token, out):
    """One of two processes: with no room on rank 1 neither uses shared memory; with room both do."""
    import torch.distributed as dist

    os.environ[shm_files.RUN_TOKEN] = token
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    local = shared_memory.connect(rank, 2, 30.0, 0)
    room = shared_reduce.room_for
    shared_reduce.room_for = (lambda n: False) if rank == 1 else room
    refused = shared_reduce.reducer(local, [0, 1], None, 1 << 20)
    shared_reduce.room_for = room
    dist.barrier()  # both have cleaned up
    left = [f for f in os.listdir(shm_files.SHM_DIR) if token in f and "reduce" in f]
    dist.barrier()
    summing = shared_reduce.reducer(local, [0, 1], None, 1 << 20)
    dist.barrier()  # both have unlinked their own file (each does so as its reducer() returns)
    # every member has mapped every file: none is left in /dev/shm while the reducer works
    mapped_left = [f for f in os.listdir(shm_files.SHM_DIR) if token in f and "reduce" in f]
    x = torch.full((300000,), float(rank + 1))  # over a MiB: two chunks
    summing.all_reduce(x)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"refused": refused is None, "left": left, "sum": x.unique().tolist(), "mapped_left": mapped_left},
                  f)
    summing.close()
    local.close()
    dist.destroy_process_group()


def test_members_agree_to_fall_back_when_one_lacks_room(tmp_path):
    import torch.multiprocessing as mp

    token = uuid.uuid4().hex[:16]
    mp.spawn(_two_members_agree, args=(f"file://{tmp_path}/init", token, str(tmp_path / "out")), nprocs=2)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"out.{rank}").read_text())
        assert seen == {"refused": True, "left": [], "sum": [3.0], "mapped_left": []}
    assert not [f for f in os.listdir(shm_files.SHM_DIR) if token in f]
