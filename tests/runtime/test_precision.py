"""bf16-mixed keeps one bf16 copy of a stage's weights per step (planner.model.precision), however many
micro-batches are in flight; the masters stay the fp32 parameters."""
import dataclasses

import pytest
import torch

from planner.profile.optim import make_optimizer
from runtime.engine import Engine
from runtime.groups import Groups
from runtime.stage import build_rank
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, reshape_plan


def _bf16_engine(global_batch):
    # one stage, GPipe: all m micro-batches are in flight at once
    plan = dataclasses.replace(plan_with(profile_of("builtin:mlp"), [], 4, global_batch, "gpipe"),
                               precision="bf16-mixed")
    topology = plan.topology()
    model = build_rank(plan, topology, 0)
    return Engine(model, plan.instruction_lists()[0], topology, 0, plan.global_batch, plan.num_micro_batches,
                  make_optimizer("sgd", model.parameters(), 0.01), torch.device("cpu"),
                  Groups(topology, 0, model.tied_groups), autocast=torch.bfloat16)


def _bf16_weights_saved(engine):
    """Distinct bf16 storages of a weight's shape that autograd saves during one step."""
    shapes = {tuple(p.shape) for p in engine.params if p.dim() >= 2}
    shapes |= {s[::-1] for s in shapes}  # a matrix product may save the transpose (a view)
    storages = set()

    def pack(tensor):
        if tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in shapes:
            storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    engine.count_saved = False  # its own saved-tensor hooks would replace these
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        engine.run_step(1)
    return len(storages)


def test_bf16_weights_held_do_not_grow_with_micro_batches_in_flight():
    two, eight = _bf16_engine(8), _bf16_engine(32)
    assert (two.m, eight.m) == (2, 8)
    for engine in (two, eight):
        engine.run_step(0)  # counts what each micro-batch holds, compute copies excluded
    # per-micro-batch autocast regions saved one cast of each weight per micro-batch (8 against 2)
    saved = _bf16_weights_saved(two)
    assert 0 < saved == _bf16_weights_saved(eight) <= sum(p.dim() >= 2 for p in two.params)
    # the held bytes are activations only: m = 8 holds four times what m = 2 holds
    assert eight.saved.peak == 4 * two.saved.peak > 0
    # between steps the stages hold their fp32 masters again, with fp32 gradients until zeroed
    module = two.rank_model.stages[0].module
    assert [id(p) for p in module.parameters()] == [id(p) for p in two.params]
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in two.params)


def test_bf16_mixed_with_ties_replicas_zero1_and_clipping_trains_like_one_process(tmp_path):
    """Tied weights across ranks, the data-parallel buckets, ZeRO-1 and clipping all act on the fp32
    masters' gradients; the saved state is the masters under the model's names."""
    plan = reshape_plan(plan_with(profile_of("tests.models:tied_lm"), [2], 2, 4, "1f1b"), data_parallel=2)
    plan = dataclasses.replace(plan, shard="optimizer", precision="bf16-mixed")
    training = dict(precision="bf16-mixed", clip_grad_norm=0.5)
    state = execute(plan, tmp_path, steps=2, lr=1.0, extra=["--clip-grad-norm", "0.5"])
    assert all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())
    # the same bf16 kernels on the same values in one process, the same fp32 accumulation (each
    # place of the tied weight its own copy): equal (0.0 here), 1e-5 as for fp32 runs, which allows
    # for the replicas' fp32 sums running in another order
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1.0, training=training)) <= 1e-5
    # ... and not what fp32 training gives (bf16 compute changed the result)
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1.0, training=dict(clip_grad_norm=0.5))) > 1e-4
    assert torch.equal(state["emb.weight"], state["head.weight"])


def test_bf16_mixed_moe_experts_run(tmp_path):
    """Mixtral's experts cast their input to the weights' dtype before an opaque custom operator
    (transformers::grouped_mm_fallback); the graph, captured with fp32 weights, does not hold that
    cast, and the run stopped with 'expected m1 and m2 to have the same dtype'. Under bf16-mixed
    the graph now computes as one bf16 process does (planner.model.casts: the experts' kernel for bf16
    weights, the casts to an activation's dtype), so the state equals it. As many key/value heads as
    query heads: with fewer, a traced transformers model repeats them where one process asks
    attention to (`enable_gqa`), and their gradients' bf16 sums run in another order."""
    args = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, seq_len=4, num_local_experts=4, num_experts_per_tok=2)
    profile = profile_of("hf:MixtralForCausalLM", args, sizes=(2,))
    plan = dataclasses.replace(plan_with(profile, [3], 2, 4, "1f1b"), precision="bf16-mixed")
    state = execute(plan, tmp_path, steps=1, lr=1.0)
    assert max_abs_diff(state, reference_state(plan, steps=1, lr=1.0, training={"precision": "bf16-mixed"})) <= 1e-5


def test_writes_that_need_one_dtype_cast_their_source_to_the_destinations():
    """LLaVA scatters its image features into the text embeddings after casting them to the
    embeddings' dtype; the graph captured by torch.export with fp32 weights holds no such cast, and
    under bf16-mixed (bf16 embeddings, fp32 features) `masked_scatter` and `index_put` refused to
    mix dtypes. Each such write now casts its source to its destination's dtype (planner.model.precision),
    which is what the model's line does in one process."""
    from planner.model.precision import match_written_dtypes

    class Scatter(torch.nn.Module):
        def forward(self, embeds, features, mask, rows):
            out = embeds.masked_scatter(mask, features.to(embeds.dtype))
            out[rows] = features[:2].to(out.dtype)  # index_put_ (rows holds two)
            return out * 2

    embeds, features = torch.randn(4, 3), torch.randn(4, 3)
    mask, rows = torch.tensor([[1, 0, 1]] * 4, dtype=torch.bool), torch.tensor([True, False, True, False])
    graph = torch.export.export(Scatter(), (embeds, features, mask, rows)).module()
    low = embeds.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):  # the premise: the captured graph mixes the dtypes
        graph(low, features, mask, rows)
    assert match_written_dtypes([graph]) == 2 and match_written_dtypes([graph]) == 0  # once per write
    assert torch.equal(graph(low, features, mask, rows), Scatter()(low, features, mask, rows))
    assert torch.equal(graph(embeds, features, mask, rows), Scatter()(embeds, features, mask, rows))  # fp32 as before


def test_traced_writes_by_keyword_function_or_operator_get_the_cast_too():
    """torch.fx records the same writes as Tensor methods (the source by keyword too), torch
    functions or operator packets; an operator that writes nothing is left alone (a packet has no
    namespace of its own: reading it stopped bf16-mixed runs of traced models that call
    torch.ops directly), and an integer destination keeps its dtype error (a cast would truncate)."""
    import torch.fx

    from planner.model.precision import match_written_dtypes

    class Writes(torch.nn.Module):
        def forward(self, x, mask, source, index):
            a = x.masked_scatter(mask, source=source)
            b = torch.masked_scatter(x, mask, source)
            c = torch.ops.aten.relu(x)
            d = x.clone().index_add_(0, index, source)
            e = torch.scatter_add(x, 0, index[:, None].expand(-1, 3), source)
            return a + b + c + d + e

    graph = torch.fx.symbolic_trace(Writes())
    assert match_written_dtypes([graph]) == 4
    x, source = torch.randn(4, 3), torch.randn(4, 3)
    mask, index = torch.rand(4, 3) > 0.5, torch.tensor([2, 0, 3, 1])
    low = x.to(torch.bfloat16)
    assert torch.equal(graph(low, mask, source, index), Writes()(low, mask, source.to(torch.bfloat16), index))
    assert torch.equal(graph(x, mask, source, index), Writes()(x, mask, source, index))
    integer = torch.fx.symbolic_trace(lambda x, mask, source: x.masked_scatter(mask, source))
    match_written_dtypes([integer])
    with pytest.raises(RuntimeError, match="dtype"):
        integer(torch.zeros(4, 3, dtype=torch.long), mask, source)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])  # zb-h1: the input part's gradient through the view
def test_bf16_mixed_fp32_value_crossing_a_cut_to_several_readers_trains_like_one_process(tmp_path, schedule):
    """An fp32 value crossing a cut (T5's encoder output, from its fp32 norm) read by several bf16
    layers: torch.autocast caches its bf16 cast of an fp32 leaf that needs a gradient (one cast for
    all readers, their bf16 gradients summed in bf16), and a received value is such a leaf; in one
    process it is computed (a cast per reader, each gradient cast to fp32, summed in fp32). The
    stage reads it through a view, as one process reads it (was 1.2e-3 apart after 2 steps)."""
    plan = dataclasses.replace(plan_with(profile_of("tests.models:normed_readers"), [2], 2, 8, schedule),
                               precision="bf16-mixed")
    assert [v["dtype"] for v in plan.stages[1].recv] == ["float32"]  # the premise: an fp32 value crosses
    state = execute(plan, tmp_path, steps=2, lr=1.0)
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1.0, training={"precision": "bf16-mixed"})) <= 1e-5
