"""Fine-tuning trains exactly like one process: frozen parameters (requires_grad=False) keep their
values, get no gradient (nor a tie's all-reduce, nor a data-parallel bucket, nor weight decay) and
the trained ones match single-process training (1e-5, fp32); a peft LoRA Llama's adapters are saved
in peft's format and load back equal."""
import os

import pytest
import torch

from planner.model.entry import build_spec
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, report_of, reshape_plan

ADAMW = ["--optimizer", "adamw", "--weight-decay", "0.1"]  # decay would move a frozen weight given a gradient


def _frozen_unchanged(state, entry, args):
    initial = build_spec(entry, args, 0).module
    frozen = [name for name, p in initial.named_parameters(remove_duplicate=False) if not p.requires_grad]
    assert frozen
    values = initial.state_dict()
    for name in frozen:
        assert torch.equal(state[name], values[name]), name
    return initial


def test_frozen_weights_and_a_frozen_tie_with_replicas(tmp_path):
    # emb (tied to head) and blocks.0 frozen: stage 0 trains nothing, the tie spans stages 0 and 1,
    # two data-parallel replicas (buckets), gpipe, AdamW with decay, clipping by the global norm
    entry = "tests.models:frozen_tied_lm"
    profile = profile_of(entry)
    assert [u.trainable_bytes for u in profile.units] == [0, 0, 1088, 1088, 0]
    plan = reshape_plan(plan_with(profile, [2], 1, 2, "gpipe"), data_parallel=2)
    state = execute(plan, tmp_path, steps=2, extra=[*ADAMW, "--clip-grad-norm", "0.05"])
    reference = reference_state(plan, steps=2, optimizer="adamw", training=dict(weight_decay=0.1, clip_grad_norm=0.05))
    assert max_abs_diff(state, reference) <= 1e-5
    initial = _frozen_unchanged(state, entry, {})
    assert (state["blocks.1.weight"] - initial.state_dict()["blocks.1.weight"]).abs().max() > 1e-3


LLAMA = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, seq_len=8)
LORA = dict(LLAMA, lora_rank=4, lora_alpha=8, lora_targets="q_proj,v_proj")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_lora_llama_trains_like_one_process_and_saves_its_adapters(tmp_path, schedule):
    # zb-h1: the weight part of each backward computes only the adapters' gradients
    PeftModel = pytest.importorskip("peft").PeftModel

    entry = "hf:LlamaForCausalLM"
    profile = profile_of(entry, LORA, sizes=(1,))
    # by hand, per layer: q_proj A 4x32 + B 32x4, v_proj A 4x32 + B 16x4 (2 kv heads of 8) = 448 fp32 parameters
    assert [u.trainable_bytes for u in profile.units] == [0, 0, 448 * 4, 448 * 4, 0, 0]
    plan = plan_with(profile, [3], 1, 4, schedule)
    assert [st.memory_bytes["grads"] for st in plan.stages] == [448 * 4, 448 * 4]  # the trainable bytes
    adapters = os.path.join(str(tmp_path), "adapters")
    state = execute(plan, tmp_path, steps=2, extra=[*ADAMW, "--save-adapters", adapters])
    assert max_abs_diff(state, reference_state(plan, steps=2, optimizer="adamw",
                                               training=dict(weight_decay=0.1))) <= 1e-5
    _frozen_unchanged(state, entry, LORA)
    lora = {k: v for k, v in state.items() if ".lora_" in k}
    assert len(lora) == 8 and max(v.abs().max() for k, v in lora.items() if ".lora_B." in k) > 1e-3
    # peft's own loader, on the base model built alone, gives back the trained adapters
    loaded = PeftModel.from_pretrained(build_spec(entry, LLAMA, 0).module, adapters).state_dict()
    assert max_abs_diff({k: loaded[k] for k in lora}, lora) == 0.0
    assert max_abs_diff(loaded, state) == 0.0
    # zb-h1's later stage is layers.1 (adapters train), norm and lm_head (frozen): after its input part
    # autograd frees the graph above the topmost frontier, inside layers.1, so the rank holds layers.1's h,
    # not all it saved and kept and the norm's saves (17376 B planned per micro-batch against 4128 held;
    # planner.cost.ranges' trained[e]); the ranks hold what the plan says, to the byte
    if schedule == "zb-h1":
        assert [u.trainable_bytes > 0 for u in profile.units[3:]] == [True, False, False]
        assert plan.stages[1].memory_bytes["weight_held_per_micro_batch"] == profile.units[3].weight_held_bytes[1]
    for rank in report_of(tmp_path)["stages"]:
        assert rank["peak_saved_bytes"] == rank["predicted_activation_bytes"], rank


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_recompute_all_leaves_a_frozen_embedding_alone(tmp_path, schedule):
    # the embedding trains nothing and reads integer tokens: its backward computes nothing. Under --recompute
    # all it was recomputed all the same, keeping its tokens (128 B a micro-batch) and running its forward again
    # for nothing; the plan now recomputes every other unit, and the ranks hold what it says and train exactly
    from planner.cost.options import CostOptions
    from planner.plan.make import make_plan
    from planner.solve.api import solve
    from runtime.stage import build_rank
    from tests.support.runs import assert_trains_like_one_process

    entry = "tests.models:frozen_embedding_lm"
    profile = profile_of(entry, sizes=(2,))
    assert [u.trainable_bytes > 0 for u in profile.units] == [False, True, True, True, True]
    opts = CostOptions(pipeline_ranks=2, global_batch=8, schedule=schedule, recompute="all")
    solution = solve(profile, opts)
    assert 0 in solution.recompute  # the solver names every unit: the plan's lists leave the embedding out
    plan = make_plan(profile, solution, opts, "")
    assert [name for st in plan.stages for name in st.recompute] == [u.name for u in profile.units[1:]]
    # what the ranks recompute: each recomputed unit a checkpointed segment of its own, the embedding none
    embedding = profile.units[0].name
    for rank, st in enumerate(plan.stages):
        (stage,) = build_rank(plan, plan.topology(), rank).stages
        assert [seg.recompute for seg in stage.module.segments] == [u != embedding for u in st.units], st.units
    assert_trains_like_one_process(plan, tmp_path, entry, steps=2)
    for rank in report_of(tmp_path)["stages"]:
        assert rank["peak_saved_bytes"] == rank["predicted_activation_bytes"], rank
