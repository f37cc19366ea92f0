"""Attention as the target runs it (issue 25): an analytic profile with the memory-efficient kernel saves
no S x S tensor; Hugging Face models run their default attention and their config's derived fields follow
the overrides."""
import pytest
import torch

from planner.model.entry import build_spec
from planner.profile.analytic import load_device_spec
from planner.profile.analytic_profile import analytic_profile

LLAMA = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=128)


def _layer(seq_len: int, attention: str, **extra):
    profile = analytic_profile("hf:LlamaForCausalLM", dict(LLAMA, seq_len=seq_len, **extra), [1],
                               load_device_spec("h100"), dtype="bfloat16", attention=attention)
    return profile, next(u for u in profile.units if u.name == "model.layers.0")


def test_memory_efficient_attention_saves_no_square_tensor():
    profile, short = _layer(128, "flash")
    _, long = _layer(256, "flash")
    assert profile.extra["attention"] == "memory-efficient"
    # everything a layer saves grows linearly in S: no S x S scores or probabilities
    assert long.saved_bytes[1] == 2 * short.saved_bytes[1]
    eager_profile, eager_short = _layer(128, "as-built", attn_implementation="eager")
    _, eager_long = _layer(256, "as-built", attn_implementation="eager")
    assert eager_profile.extra["attention"] == "eager"
    # eager keeps the probabilities (4 heads x S x S bf16, and more): the S^2 term is there
    square = eager_long.saved_bytes[1] - 2 * eager_short.saved_bytes[1]
    assert square >= 4 * 256 * 256 * 2 - 2 * 4 * 128 * 128 * 2
    assert eager_short.saved_bytes[1] > short.saved_bytes[1]


def test_memory_efficient_attention_flops():
    # one layer's attention at S = 256, 4 heads of 16: forward 4 B H S^2 D / 2 (causal), backward 2.5 x
    _, flash = _layer(256, "flash")
    _, math = _layer(256, "as-built")  # sdpa on the meta device: the math path
    assert flash.forward_s[1] < math.forward_s[1] and flash.backward_s[1] < math.backward_s[1]


def test_hf_config_follows_overrides_and_default_attention():
    with torch.device("meta"):
        spec = build_spec("hf:LlamaForCausalLM", dict(LLAMA, seq_len=8), 0)
    config = spec.module.config
    assert config.head_dim == 16  # 64 / 4, not the default config's 4096 / 32
    assert tuple(spec.module.model.layers[0].self_attn.q_proj.weight.shape) == (64, 64)
    assert config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attn_implementation 'flash_attention_2'"):
        build_spec("hf:LlamaForCausalLM", dict(LLAMA, seq_len=8, attn_implementation="flash_attention_2"), 0)


def test_profiling_batch_first_multihead_attention_emits_no_layout_warning():
    # a latent expanded over the batch crosses a cut as the query of batch_first MultiheadAttention layers: the
    # profile times each unit's backward into its own leaves of the unit's inputs, whose gradients the layer lays
    # out transposed, and `planner profile` printed torch's "gradient layout contract" UserWarning about them
    import warnings

    from planner.profile.measure import profile_model

    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # (torch warns once a process: always here, whatever ran before)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            profile = profile_model("tests.models:latent_attention", {}, [2], repeats=1)
    finally:
        torch.set_warn_always(before)
    assert [u.name for u in profile.units] == ["embed", "attention.0", "attention.1"]
    assert not [w for w in seen if "gradient layout contract" in str(w.message)]
