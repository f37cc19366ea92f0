"""Under bf16-mixed an exported graph computes what the model's code computes under bf16
(planner.model.casts): casts to a tensor's dtype, reads of a cast that did nothing in fp32, casts only
bf16 makes and dtype-made constants, without moving what crosses a cut."""
import dataclasses

import torch
import torch.utils._pytree as pytree

from planner.model.capture import capture
from planner.model.example import EXAMPLE_BATCH_SIZE
from planner.model.entry import build_spec
from planner.model.spec import call_model
from planner.model.casts import recast
from planner.model.meta import meta_builder
from runtime.initstate import InitState
from planner.model.precision import ComputeCopy
from runtime.stage import build_rank
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state

ENTRY = "tests.capture_models:casts_like_hf"


def _on_meta(args):
    return meta_builder(ENTRY, args, 0)


def _bf16_forward(module, run):
    copy = ComputeCopy([module], torch.bfloat16)
    copy.install()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run()
    finally:
        copy.remove()


def _captured_and_eager(args):
    spec = build_spec(ENTRY, args, 0)
    inputs = spec.batch(4, 0)[0]
    captured = capture(spec.module)
    assert captured.method == "export"
    eager = _bf16_forward(spec.module, lambda: call_model(spec.module, inputs))

    def graph():
        out = _bf16_forward(captured.gm, lambda: captured.gm(*captured.input_values(inputs)))
        return pytree.tree_leaves(out)[0]
    return spec, captured, eager, graph


def test_an_exported_graph_computes_as_one_bf16_mixed_process():
    spec, captured, eager, graph = _captured_and_eager({})
    assert not torch.equal(graph(), eager)  # the premise: fp32 casts, a residual read through a cast
    crossing = [[n.name for n in captured.crossing(k)] for k in range(len(captured.units) + 1)]
    changed, left = recast(captured, _on_meta({}), spec.batch(EXAMPLE_BATCH_SIZE, 0)[0], torch.bfloat16)
    assert changed > 0 and left is None
    assert torch.equal(graph(), eager)
    assert [[n.name for n in captured.crossing(k)] for k in range(len(captured.units) + 1)] == crossing


def test_a_rank_built_on_meta_takes_the_casts_too(tmp_path):
    # --init-state captures on meta: nodes naming a device are placed on the run's before the second
    # export is matched to them (they had no twin, and kept their fp32 dtype and mask value)
    plan = dataclasses.replace(plan_with(profile_of(ENTRY, sizes=(2,)), [2], 2, 4, "1f1b"), precision="bf16-mixed")
    path = str(tmp_path / "init.pt")
    torch.save(build_spec(ENTRY, {}, 0).module.state_dict(), path)
    for rank in (0, 1):
        model = build_rank(plan, plan.topology(), rank, init_state=InitState(path), autocast=torch.bfloat16)
        assert model.precision_note == ""


def test_a_read_that_would_change_a_cuts_message_stays():
    # the residual is summed by the next unit: reading the block's input instead of its norm's
    # no-op cast would send another value across that cut, so that read stays as in fp32
    args = dict(add_apart=True)
    spec, captured, eager, graph = _captured_and_eager(args)
    crossing = [[n.name for n in captured.crossing(k)] for k in range(len(captured.units) + 1)]
    changed, left = recast(captured, _on_meta(args), spec.batch(EXAMPLE_BATCH_SIZE, 0)[0], torch.bfloat16)
    assert changed > 0 and "1 of its reads stay as in fp32" in left
    assert [[n.name for n in captured.crossing(k)] for k in range(len(captured.units) + 1)] == crossing
    assert graph().isfinite().any() and not torch.equal(graph(), eager)


def test_a_second_export_that_fails_leaves_the_graph_and_says_why():
    spec, captured, _, graph = _captured_and_eager({})
    before = graph()

    def failing():
        raise RuntimeError("no second export\nmore")
    changed, left = recast(captured, failing, spec.batch(2, 0)[0], torch.bfloat16)
    assert changed == 0 and left.endswith("(the export under bf16 autocast failed: RuntimeError: no second export)")
    assert torch.equal(graph(), before)


def test_bf16_mixed_run_of_an_exported_model_trains_like_one_process(tmp_path):
    plan = dataclasses.replace(plan_with(profile_of(ENTRY, sizes=(2,)), [2], 2, 4, "1f1b"), precision="bf16-mixed")
    state = execute(plan, tmp_path, steps=2, lr=1.0)
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1.0, training={"precision": "bf16-mixed"})) <= 1e-5
    assert "bf16-mixed:" not in (tmp_path / "execute.out").read_text()


def test_a_run_says_where_its_graph_keeps_fp32_reads(tmp_path):
    args = dict(add_apart=True)
    plan = dataclasses.replace(plan_with(profile_of(ENTRY, args, sizes=(2,)), [2], 2, 4, "1f1b"),
                               precision="bf16-mixed")
    execute(plan, tmp_path, steps=1)
    assert "1 of its reads stay as in fp32" in (tmp_path / "execute.out").read_text()
