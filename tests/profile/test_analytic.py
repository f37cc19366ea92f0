"""Analytic profiles: meta-device capture, FLOP/byte counts, roofline times from a device spec."""
import json

import pytest
import torch

from planner.profile.analytic import CostCounter, DeviceSpec, DeviceSpecError, load_device_spec
from planner.profile.analytic_profile import analytic_profile
from planner.profile.profile import Profile

FLAT = DeviceSpec(name="test", peak_flops={"float32": 1e12}, memory_bandwidth=1e11, efficiency=0.5)


def test_shipped_specs_load_and_unknown_names_say_what_exists(tmp_path):
    for name in ("a100", "h100", "h200"):
        spec = load_device_spec(name)
        assert spec.peak("bfloat16") > spec.peak("float32") > 1e12 and spec.memory_bandwidth > 1e12
    with pytest.raises(DeviceSpecError, match="a100, h100, h200"):
        load_device_spec("tpu9")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "peak_flops": {"float32": 2e12}, "memory_bandwidth": 1e11}))
    assert load_device_spec(str(path)).peak("bfloat16") == 2e12  # falls back to float32
    path.write_text(json.dumps({"name": "broken"}))
    with pytest.raises(DeviceSpecError, match="peak_flops"):
        load_device_spec(str(path))
    good = {"name": "mine", "peak_flops": {"float32": 2e12}, "memory_bandwidth": 1e11}
    for bad in ({"memory_bandwidth": 0}, {"peak_flops": {"float32": float("nan")}}, {"efficiency": 0},
                {"efficiency": 1.5}, {"op_overhead_s": -1e-6}, {"memory_bytes": -1},
                {"peak_flops": {"float32": 1e-300}}):  # (times of 1e303 s: a profile solve refuses, later)
        path.write_text(json.dumps({**good, **bad}))  # a division by zero, or a profile solve refuses, later
        with pytest.raises(DeviceSpecError, match="finite and at least 1e3, efficiency in"):
            load_device_spec(str(path))
    path.write_text(json.dumps({**good, "memory_bytes": float("inf")}))  # a traceback (OverflowError)
    with pytest.raises(DeviceSpecError, match="is malformed .OverflowError"):
        load_device_spec(str(path))
    with pytest.raises(DeviceSpecError, match="is not a regular file"):  # read for ever
        load_device_spec("/dev/zero")


def test_matmul_is_compute_bound_and_copy_is_memory_bound():
    a, b = torch.empty(256, 512, device="meta"), torch.empty(512, 1024, device="meta")
    with CostCounter(FLAT) as counter:
        torch.mm(a, b)
    flops = 2 * 256 * 512 * 1024
    moved = 4 * (256 * 512 + 512 * 1024 + 256 * 1024)
    assert counter.costs.flops == flops and counter.costs.bytes == moved
    assert counter.costs.seconds == pytest.approx(max(flops / 1e12, moved / 1e11) / 0.5)
    with CostCounter(FLAT) as counter:
        a.t()  # a view moves nothing
        a * 2
    assert counter.costs.flops == 0 and counter.costs.bytes == 2 * 4 * 256 * 512


def test_analytic_profile_has_measured_shape_without_parameter_memory():
    profile = analytic_profile("builtin:gpt", {"layers": 2}, [1, 2], FLAT)
    assert isinstance(Profile.from_json(profile.to_json()), Profile)  # a valid profile for the solver
    assert [u.name for u in profile.units] == ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "ln_f", "head"]
    block = profile.units[2]
    assert block.param_bytes == 4 * (2 * 64 + 64 * 192 + 192 + 64 * 64 + 64 + 2 * 64 + 64 * 256 + 256 + 256 * 64 + 64)
    assert block.forward_s[2] == pytest.approx(2 * block.forward_s[1], rel=0.2)
    assert block.backward_s[1] > block.forward_s[1] > 0 and block.saved_bytes[2] > block.saved_bytes[1] > 0
    assert profile.cut(2).values[0].bytes[2] == 2 * 32 * 64 * 4
    assert profile.device == "analytic" and profile.extra["analytic"]["device_spec"]["name"] == "test"


def test_hf_model_profiles_on_meta_in_bfloat16():
    pytest.importorskip("transformers")
    args = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True, "seq_len": 16}
    profile = analytic_profile("hf:LlamaForCausalLM", args, [1, 2], load_device_spec("h100"), dtype="bfloat16")
    assert profile.capture == "export" and profile.dtype == "bfloat16"
    assert profile.units[0].param_bytes == 256 * 64 * 2
    assert profile.extra["shared_parameters"][0]["units"] == ["model.embed_tokens", "lm_head"]


def test_an_analytic_profile_counts_what_a_stage_computes_from_its_parameters():
    # T5's decoder blocks read the position bias the first one computes from its table: in a stage holding
    # that block each later one keeps its scores' gradient for the weight part (planner.cost.inner_weight),
    # found on meta as measured (a measured profile counts 2 x 4 heads x 8 x 8 fp32 bytes a block, the S x S
    # scores' gradient of CPU's math attention; on meta, costed as the memory-efficient kernel a GPU runs
    # (docs/profile.md, --attention flash), each block keeps its (2, 4, 8, 4) output's gradient: 1,024)
    pytest.importorskip("transformers")
    args = dict(vocab_size=64, d_model=16, d_ff=32, d_kv=4, num_layers=1, num_decoder_layers=3, num_heads=4, seq_len=8)
    profile = analytic_profile("hf:T5ForConditionalGeneration", args, [2], FLAT, dtype="float32")
    names = [u.name for u in profile.units]
    source = str(names.index("decoder.block.0"))
    inner = [profile.units[names.index(block)].inner_weight_bytes[2] for block in ("decoder.block.1", "decoder.block.2")]
    assert inner[0] == inner[1] and list(inner[0]) == [source] and 0 < inner[0][source] <= 2 * 4 * 8 * 8 * 4
    assert not any(u.inner_weight_bytes.get(2) for u in profile.units[:names.index("decoder.block.0")])


def test_models_that_cannot_run_on_meta_are_one_line():
    from planner.errors import CaptureError
    # an operation whose result the values decide (a mixture of experts' nonzero) has no meta kernel
    with pytest.raises(CaptureError, match="operation 'nonzero' in module 'blocks.0' cannot run there.*without "
                                           "--analytic"):
        analytic_profile("tests.capture_models:routed", {}, [2], FLAT)
    # the model's own error at a size it cannot take (BatchNorm on one sample) names the operation
    with pytest.raises(CaptureError, match="failed on a batch of 1: operation 'norm'.*Expected more than 1 value"):
        analytic_profile("tests.capture_models:routed", {}, [1], FLAT)
