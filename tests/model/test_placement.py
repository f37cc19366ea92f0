"""A captured graph placed on another device: the devices its nodes were captured with move too
(torch.export records `arange(..., device=cpu)`; on a GPU those tensors would stay on the host)."""
import pytest
import torch

from planner.model.capture import capture
from planner.model.entry import build_spec

LLAMA = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, seq_len=16)


def _captured_on_meta(place: bool):
    spec = build_spec("hf:LlamaForCausalLM", LLAMA, 0)
    captured = capture(spec.module)
    assert captured.method == "export"
    captured.gm.to("meta")
    if place:
        captured.place_nodes(torch.device("meta"))
    inputs, _ = spec.batch(2, 0)
    return captured, [v.to("meta") if isinstance(v, torch.Tensor) else v for v in captured.input_values(inputs)]


def test_nodes_follow_the_graph_to_another_device():
    captured, args = _captured_on_meta(place=True)
    # the graph and the graphs nested in it (higher-order operations such as wrap_with_set_grad_enabled,
    # which some transformers versions export around the rotary embedding, keep a body submodule)
    graphs = [m for m in captured.gm.modules() if isinstance(m, torch.fx.GraphModule)]
    assert not [n.name for g in graphs for n in g.graph.nodes
                if any(isinstance(v, torch.device) and v.type == "cpu" for v in [*n.args, *n.kwargs.values()])]
    logits = captured.gm(*args).logits
    assert logits.device.type == "meta" and logits.shape[0] == 2


def test_without_placing_the_nodes_the_graph_mixes_devices():
    captured, args = _captured_on_meta(place=False)
    with pytest.raises(Exception):
        captured.gm(*args)


def test_exported_graphs_carry_no_dtype_checks():
    """torch.export asserts each tensor's traced dtype; under autocast (bf16-mixed) on a GPU the
    values are bf16 and the check failed the run (`Tensor dtype mismatch! Expected: Float`)."""
    spec = build_spec("hf:LlamaForCausalLM", LLAMA, 0)
    captured = capture(spec.module)
    check = torch.ops.aten._assert_tensor_metadata.default
    assert not [n for m in captured.gm.modules() if isinstance(m, torch.fx.GraphModule)
                for n in m.graph.nodes if n.target is check]
    inputs, _ = spec.batch(2, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert captured.gm(*captured.input_values(inputs)).logits.dtype == torch.bfloat16
